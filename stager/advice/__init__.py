"""Advice for users: file-system hints and the staging-strategy scaling model."""
