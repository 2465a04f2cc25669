"""The `plait` command."""

import argparse
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(prog="plait", description="plait: collectives over TCP between ordinary machines")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="command")
    demo = sub.add_parser("demo", help="run every collective on a few local ranks, then an allreduce sweep")
    demo.add_argument("--nproc", type=int, default=3, help="number of local ranks (default 3, at least 2)")
    demo.add_argument("--quick", action="store_true", help="smaller sweep and reference transfer")
    demo.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.version:
        import plait

        print(f"plait {plait.__version__}")
        return 0
    if args.command == "demo":
        if args.nproc < 2:
            parser.error("--nproc must be at least 2")
        from .demo import run

        return run(nproc=args.nproc, quick=args.quick, json_path=args.json)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
