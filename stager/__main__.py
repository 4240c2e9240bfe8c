from stager.cli import entry

entry()
