"""`python -m dflash_lab.train ...`: see cli.py."""

from .cli import main

main()
