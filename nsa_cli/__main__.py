"""``python -m nsa_cli ...`` (used under torchrun)."""

from nsa_cli.app import main

main()
