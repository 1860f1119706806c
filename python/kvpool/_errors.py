"""kvpool's exception, defined in Python so that the native module can be
built against Python's stable ABI from 3.11 on (a native class subclassing
``Exception`` needs 3.12 there)."""


class KvpoolError(Exception):
    """An error from kvpool: ``code`` is kvpool's stable error code (see
    ``kvpool.ERROR_CODES``), ``name`` its name, ``message`` why."""

    def __init__(self, code: int, name: str, message: str) -> None:
        super().__init__(code, name, message)
        self.code = code
        self.name = name
        self.message = message

    def __str__(self) -> str:
        return f"{self.name} ({self.code}): {self.message}"

    def __repr__(self) -> str:
        return f"KvpoolError(code={self.code}, name={self.name!r}, message={self.message!r})"
