"""Errors the CLI reports as one line without a traceback: UserError (exit 2) and RankLostError (exit 1)."""


class UserError(Exception):
    """An error caused by user input (a file, a flag, a name); the CLI prints it as one line, exit 2."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class RankLostError(RuntimeError):
    """A collective failed in a multi-process run: another rank died, was killed, or did not answer in time."""


def located(path: object, line: int | None, field: str | None, what: str) -> UserError:
    """Build a UserError that names the file, the line and the field: 'data.jsonl:3: field "label": ...'."""
    where = str(path) + (f":{line}" if line is not None else "")
    return UserError(f"{where}: " + (f'field "{field}": ' if field else "") + what)
