"""python -m adaptive_eager COMMAND [ARGS...]: tools around the neuron device."""
import sys

# command -> (module, one-line description); each module has main(argv) -> exit code
COMMANDS = {
    "demo": ("tools.demo", "train a small GPT in eager and adaptive eager, compare launches and time"),
    "run": ("tools.run", "run an unchanged script once per mode and compare what each mode does"),
    "report": ("tools.report", "compare the modes of a saved neuron_benchmark run"),
    "config": ("config", "list every setting: its environment variable, value and effect"),
}


def usage() -> str:
    w = max(map(len, COMMANDS))
    lines = ["usage: python -m adaptive_eager [-h] COMMAND [ARGS...]", "",
             "Tools for the simulated neuron device (adaptive eager, fusion, torch.compile).",
             "", "commands:"]
    lines += [f"  {name:<{w}}  {desc}" for name, (_, desc) in COMMANDS.items()]
    lines += ["", "`python -m adaptive_eager COMMAND --help` describes a command's options.",
              "With no command, `demo` runs."]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    cmd, rest = (argv[0], argv[1:]) if argv else ("demo", [])
    if cmd not in COMMANDS:
        print(f"python -m adaptive_eager: unknown command {cmd!r}\n\n{usage()}",
              file=sys.stderr)
        return 2
    if cmd == "config":
        if rest and rest[0] in ("-h", "--help"):
            print("usage: python -m adaptive_eager config\n\n" + COMMANDS["config"][1])
            return 0
        from .config import describe
        print(describe())
        return 0
    import importlib

    import torch  # noqa: F401  (first: the tools import `device`, Note [Lazy package])
    module = importlib.import_module(f"adaptive_eager.{COMMANDS[cmd][0]}")
    return module.main(rest)


if __name__ == "__main__":
    sys.exit(main())
