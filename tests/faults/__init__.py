"""Fault-injection suite (docs/reliability.md): fast subsets run in `make test`, full counts under `-m faults`."""
