"""`--json`, the same option in every tool: `--json PATH` writes the tool's results as JSON to
PATH; `--json -` (or `--json` alone) writes them to stdout, which then holds the JSON alone: the
tables the tool would print are left out (the JSON holds the same figures), and what else it says
(progress, errors, its verdict) goes to stderr."""

import json
import sys

JSON_HELP = ("write the results as JSON to PATH; `--json -` (or --json alone) writes them to stdout "
             "instead of the tables, with progress and errors on stderr")


def add_json_option(parser, help=JSON_HELP):
    parser.add_argument("--json", nargs="?", const="-", metavar="PATH", help=help)


def to_stdout(json_path):
    """True when `--json` sends the JSON to stdout (so nothing else may go there)."""
    return json_path == "-"


def write_json(json_path, obj, indent=1):
    """Writes obj to the `--json` destination: stdout for `-`, else the file."""
    text = json.dumps(obj, indent=indent) + "\n"
    if to_stdout(json_path):
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        with open(json_path, "w") as f:
            f.write(text)
