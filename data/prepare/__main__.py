"""`python -m data.prepare` (the command line: data.prepare.cli)."""

from data.prepare.cli import main

main()
