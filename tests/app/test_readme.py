"""The README's commands are the ones `ddtree --help` lists: every command has its section and an
example there, the README names no command the CLI lacks, and every flag an example shows is in
that command's `--help`."""

from __future__ import annotations

import re
import shlex

from typer.testing import CliRunner

from conftest import REPO
from ddtree.app.cli import app

SEPARATORS = {"|", "||", "&&", ";", "&"}


def help_text(*args: str) -> str:
    r = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.stdout + r.stderr
    return r.stdout


def listed_commands() -> list[str]:
    """The commands `ddtree --help` lists, in its order."""
    section = help_text().split("Commands:", 1)[1]
    return [m.group(1) for m in re.finditer(r"^\s{2}([a-z][\w-]*)\s", section, re.M)]


def invocations(markdown: str) -> list[tuple[str, list[str]]]:
    """(command, flags) of every `ddtree ...` in the fenced shell blocks and the inline code spans
    (headings aside) of a markdown text; env assignments, pipes and && chains are understood,
    comments dropped."""
    blocks = [body for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", markdown, re.M | re.S)  # fences in pairs
              if lang in ("", "bash", "sh", "shell")]
    lines = [ln for b in blocks for ln in b.replace("\\\n", " ").splitlines()]
    prose = re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S)
    lines += [span for ln in prose.splitlines() if not ln.startswith("#") for span in re.findall(r"`(ddtree [^`]*)`", ln)]
    out = []
    for line in lines:
        lex = shlex.shlex(line, posix=True, punctuation_chars="|&;")
        lex.whitespace_split = True
        lex.commenters = "#"
        words, segment = list(lex), []
        for w in words + [";"]:
            if w not in SEPARATORS:
                segment.append(w)
                continue
            while segment and re.match(r"^[A-Za-z_]\w*=", segment[0]):  # VAR=value before a command
                segment.pop(0)
            if segment[:1] == ["ddtree"] and len(segment) > 1:
                out.append((segment[1], [s.split("=", 1)[0] for s in segment[2:] if s.startswith("-") and s != "-"]))
            segment = []
    return out


def section_texts(markdown: str) -> list[tuple[str, str]]:
    """(heading line, its text up to the next heading) for every heading of a markdown text."""
    parts = re.split(r"^(#{1,4} .*)$", markdown, flags=re.M)
    return list(zip(parts[1::2], parts[2::2]))


def problems(markdown: str, commands: list[str], helps: dict[str, str]) -> list[str]:
    """What in a README disagrees with the CLI (empty: nothing). Flags in a command section's prose
    must be in that command's --help; those before the first command section (## Commands) in
    every command's."""
    found = []
    sections = re.findall(r"^#{2,4} `ddtree ([a-z][\w-]*)`", markdown, re.M)
    examples = invocations(markdown)
    for c in commands:
        if c not in sections:
            found.append(f"`ddtree {c}` has no section (a heading ### `ddtree {c}`)")
        if not any(cmd == c for cmd, _ in examples):
            found.append(f"`ddtree {c}` has no example")
    for c in sections:
        if c not in commands:
            found.append(f"section `ddtree {c}`: no such command in `ddtree --help`")
    for heading, body in section_texts(markdown):  # flags named in a command's prose
        cmd = re.match(r"#{2,4} `ddtree ([a-z][\w-]*)`", heading)
        for f in sorted(set(re.findall(r"`(--?[a-z][\w-]*)", re.sub(r"^```.*?^```", "", body, flags=re.M | re.S)))):
            targets = [cmd.group(1)] if cmd else commands if heading == "## Commands" else []
            for c in targets:
                if c in helps and not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", helps[c]):
                    found.append(f"`{f}` under `{heading}`: not in `ddtree {c} --help`")
    for cmd, flags in examples:
        if cmd not in commands:
            found.append(f"example `ddtree {cmd}`: no such command in `ddtree --help`")
            continue
        for f in flags:
            if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", helps[cmd]):
                found.append(f"example `ddtree {cmd} ... {f}`: not in `ddtree {cmd} --help`")
    return found


def test_readme_documents_exactly_the_commands_and_flags_of_the_cli():
    commands = listed_commands()
    assert {"generate", "chat", "bench", "plan", "plot", "selftest"} <= set(commands), commands
    helps = {c: help_text(c) for c in commands}
    readme = (REPO / "README.md").read_text()
    assert len(invocations(readme)) >= len(commands)
    assert problems(readme, commands, helps) == []


def test_the_readme_check_finds_what_disagrees():
    """The check above on small texts, so that it cannot pass by reading nothing."""
    commands = ["generate", "plan"]
    helps = {"generate": "Options:\n  -t, --target REF  ...\n  --raw / --no-raw  ...\n  -n, --max-new-tokens N",
             "plan": "Options:\n  --gpu-memory SPEC  ..."}
    good = ("### `ddtree generate`\n\n```bash\nOMP_NUM_THREADS=1 ddtree generate -t x --no-raw -n 4 \\\n"
            "    \"a # b\"  # a comment --nope\necho hi | ddtree generate -t x -\n```\n\n"
            "### `ddtree plan`\n\nRun `ddtree plan --gpu-memory=2x48GiB` anywhere.\n")
    assert invocations(good) == [("generate", ["-t", "--no-raw", "-n"]), ("generate", ["-t"]),
                                 ("plan", ["--gpu-memory"])]
    assert problems(good, commands, helps) == []
    assert problems(good.replace("--no-raw", "--no-such-flag"), commands, helps) == [
        "example `ddtree generate ... --no-such-flag`: not in `ddtree generate --help`"]
    assert problems(good.replace("--no-raw", "--target-x"), commands, helps) == [
        "example `ddtree generate ... --target-x`: not in `ddtree generate --help`"]
    assert problems(good + "\n### `ddtree serve`\n", commands, helps) == [
        "section `ddtree serve`: no such command in `ddtree --help`"]
    assert problems(good.replace("### `ddtree plan`", "### Planning"), commands, helps) == [
        "`ddtree plan` has no section (a heading ### `ddtree plan`)"]
    assert problems(good, commands + ["chat"], {**helps, "chat": ""}) == [
        "`ddtree chat` has no section (a heading ### `ddtree chat`)", "`ddtree chat` has no example"]
    assert problems(good + "\n`ddtree plot x`\n", commands, helps) == [
        "example `ddtree plot`: no such command in `ddtree --help`"]
    prose = good.replace("anywhere.", "anywhere; `--budget N` sets the tree.")
    assert problems(prose, commands, helps) == ["`--budget` under `### `ddtree plan``: not in `ddtree plan --help`"]
    shared = "## Commands\n\nEvery command takes `--target REF`.\n\n" + good
    assert problems(shared, commands, helps) == ["`--target` under `## Commands`: not in `ddtree plan --help`"]
