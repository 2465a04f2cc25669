"""What the tools print with: rich's Console, Table and Progress when rich is installed (the
`tools` extra; the `torch` and `test` extras include it), else plain-text stand-ins with the few
methods the tools use, so that every tool works without rich, in black and white."""

import re
import shutil
import sys

try:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    from rich.table import Table

    RICH = True
except ImportError:
    RICH = False

    # The markup the tools write: [red]...[/], [bold green]..., [dim]...[/dim].
    _MARKUP = re.compile(r"\[/?(?:(?:bold|dim|italic|red|green|yellow|blue|cyan|magenta)\s*)*\]")

    def _plain(text):
        return _MARKUP.sub("", text)

    class Table:
        def __init__(self, title=None, title_justify=None, **_):
            self.title = title
            self._cols = []  # (header, justify)
            self._rows = []

        def add_column(self, header="", justify="left", **_):
            self._cols.append((_plain(str(header)), justify))

        def add_row(self, *cells):
            self._rows.append([_plain(str(c)) for c in cells])

        def add_section(self):
            if self._rows:
                self._rows.append(None)  # a blank line before the next rows

        def _trimmed(self):
            rows = list(self._rows)
            while rows and rows[-1] is None:
                rows.pop()
            return rows

        @property
        def row_count(self):
            return sum(r is not None for r in self._rows)

        def render(self):
            rows = [[h for h, _ in self._cols]] + [r for r in self._rows if r is not None]
            widths = [max(len(r[i]) if i < len(r) else 0 for r in rows) for i in range(len(self._cols))]

            def line(cells):
                out = []
                for i, (_, justify) in enumerate(self._cols):
                    c = cells[i] if i < len(cells) else ""
                    out.append(c.rjust(widths[i]) if justify == "right" else c.ljust(widths[i]))
                return "  ".join(out).rstrip()

            text = [line(rows[0]), "  ".join("-" * w for w in widths)] + [line(r or []) for r in self._trimmed()]
            if self.title:
                text.insert(0, _plain(str(self.title)))
            return "\n".join(text)

    class Console:
        def __init__(self, file=None, stderr=False, width=None, quiet=False, **_):
            self.file = file
            self.stderr = stderr
            self.quiet = quiet
            self.width = width or shutil.get_terminal_size().columns

        def _out(self):
            return self.file or (sys.stderr if self.stderr else sys.stdout)

        def print(self, *objects, markup=True, **_):
            if self.quiet:
                return
            parts = [o.render() if isinstance(o, Table) else (_plain(str(o)) if markup else str(o)) for o in objects]
            out = self._out()
            out.write(" ".join(parts) + "\n")
            out.flush()

        def rule(self, title="", **_):
            self.print(f"-- {title} --" if title else "-" * 20)

        def status(self, text, **_):
            self.print(text)
            return _Status()

    class _Status:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, *args, **kwargs):
            pass

    class _Task:
        def __init__(self, description, total):
            self.description, self.total, self.completed = description, total, 0

    class Progress:
        """Keeps the counts the callers read back; shows nothing."""

        def __init__(self, *columns, **_):
            self.tasks = []

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def add_task(self, description, total=None, **_):
            self.tasks.append(_Task(description, total))
            return len(self.tasks) - 1

        def update(self, task, *, completed=None, total=None, description=None, **_):
            t = self.tasks[task]
            if completed is not None:
                t.completed = completed
            if total is not None:
                t.total = total
            if description is not None:
                t.description = description

    def _column(*args, **kwargs):
        return None

    BarColumn = SpinnerColumn = TextColumn = TimeElapsedColumn = _column
