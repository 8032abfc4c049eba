"""Test doubles. Nothing here moves bytes over real hardware: see each module's docstring."""
