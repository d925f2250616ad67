"""`python -m ddtree ...` is the `ddtree` command."""

from ddtree.app.cli import app

if __name__ == "__main__":
    app(prog_name="ddtree")
