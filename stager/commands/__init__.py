"""Sub-commands of the ``stager`` CLI: each module has ``register(subparsers)``; see stager/cli.py."""
