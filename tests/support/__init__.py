"""Shared test helpers, imported as modules (``from tests.support.x import y``) rather than through
conftest files: fixtures stay in conftest, code that tests call lives here."""
