"""`python -m ddtree ...` is the `ddtree` command."""

from ddtree.cli import app

if __name__ == "__main__":
    app(prog_name="ddtree")
