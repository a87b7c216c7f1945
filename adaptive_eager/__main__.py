"""python -m adaptive_eager {demo,report,config}"""
import sys


def main() -> int:
    cmd, rest = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else ("demo", [])
    if cmd == "demo":
        from .demo import main as demo
        return demo(rest)
    if cmd == "report":
        from .report import main as report
        return report(rest)
    if cmd == "config":
        from .config import describe
        print(describe())
        return 0
    print(__doc__, file=sys.stderr)
    return 2


sys.exit(main())
