"""Assertions shared by the Python tests."""

import pytest


def raises(exc, *names):
    """pytest.raises(exc) that also checks each of `names` is in the message."""

    class _Ctx:
        def __enter__(self):
            self.ctx = pytest.raises(exc)
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *args):
            suppress = self.ctx.__exit__(*args)
            if not suppress:
                return False
            msg = str(self.info.value)
            for name in names:
                assert name in msg, f"message {msg!r} does not name {name!r}"
            return suppress

    return _Ctx()
