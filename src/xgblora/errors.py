"""Errors the CLI reports as one line without a traceback: UserError (exit 2) and RankLostError (exit 1)."""


class UserError(Exception):
    """An error caused by user input (a file, a flag, a name); the CLI prints it as one line, exit 2."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class RankLostError(RuntimeError):
    """A collective failed in a multi-process run: another rank died, was killed, or did not answer in time."""


def located(path: object, line: int | str | None, field: str | None, what: str) -> UserError:
    """A UserError naming the file, the line (or a row) and the field: 'data.jsonl:3: field "label": ...',
    'data.csv, row 3: field "label": ...'."""
    where = str(path) + (f":{line}" if isinstance(line, int) else f", {line}" if line else "")
    return UserError(f"{where}: " + (f'field "{field}": ' if field else "") + what)
