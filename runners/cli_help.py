"""`python run.py --help`: what a user can choose, read from conf/ at the time of asking.

Hydra's own listing shows every ConfigStore entry, the `*_schema` structured configs included, and says
nothing of the modes or the exit codes. This text is Hydra's help template (conf/config.yaml
`hydra.help.template: ${harness_help:}`): the systems are the registered config classes (systems/registry.py),
each with the first sentence of its docstring; every other group's options are its yaml files, each with the
first sentence of its leading comment; so a new system or model appears here with no edit.
"""
from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from systems import paths

CONF = paths.conf_dir()
GROUPS = ("system", "model", "workload", "environment")

MODES = (
    ("execute", "run the system on this host and time it (the default)"),
    ("simulate", "the same decisions on a modelled machine, no hardware needed (fiddler/sim)"),
    ("serve", "start the system's OpenAI-compatible server until SIGTERM (conf: serve.*)"),
)

# run.py's exit statuses (it and runners/callbacks.py return them)
EXIT_CODES = (
    (0, "every configuration ok or skipped"),
    (1, "something failed: a configuration not ok, or a sweep job that did not run"),
    (2, "a bad configuration, refused before anything ran"),
)


def _summary(path: Path, width: int = 90) -> str:
    """The first sentence of a yaml file's leading comment (after `# @package ...`), cut to `width`."""
    words = []
    for line in path.read_text().splitlines():
        text = line.strip()
        if not text.startswith("#"):
            break
        text = text.lstrip("#").strip()
        if not text.startswith("@package"):
            words += text.split()
    return _first_sentence(words, width)


def _first_sentence(words: list[str], width: int = 90) -> str:
    sentence = " ".join(words)
    depth, end = 0, -1
    for i, ch in enumerate(sentence):  # ". " outside parentheses: "(the paper's Fig. 6)" goes on
        depth += (ch == "(") - (ch == ")")
        if depth <= 0 and sentence.startswith(". ", i):
            end = i
            break
    sentence = sentence if end < 0 else sentence[:end + 1]
    return sentence if len(sentence) <= width else sentence[:width - 3].rsplit(" ", 1)[0] + "..."


def _options(group: str, conf: Path) -> list[tuple[str, str]]:
    if group == "system":
        from systems.registry import system_classes

        return [(name, _first_sentence((cls.__doc__ or "").split()) + (f" [extra: {cls.extra}]" if cls.extra else ""))
                for name, cls in sorted(system_classes().items())]
    return [(p.stem, _summary(p)) for p in sorted((conf / group).glob("*.yaml"))]


def _table(rows, width: int) -> list[str]:
    return [f"  {str(k):<{width}} {v}".rstrip() for k, v in rows]


def text(conf: Path = CONF) -> str:
    out = ["run.py: benchmark Fiddler and the systems it is compared with (README.md, docs/).", "",
           "  python run.py [group=option ...] [key=value ...]       one job",
           "  python run.py -m group=a,b [key=x,y ...]               a sweep: every combination",
           "  python run.py -m +experiment=<name>                    a paper experiment", ""]
    for group in GROUPS:
        out += [f"== {group}= ==", *_table(_options(group, conf), 28), ""]
    out += ["== +experiment= (with -m) ==", *_table(_options("experiment", conf), 28), ""]
    out += ["== mode= ==", *_table(MODES, 10), ""]
    out += ["== exit status ==", *_table(EXIT_CODES, 3), ""]
    out += ["The composed configuration with its defaults: python run.py --cfg job [overrides]",
            "Hydra's own flags (launchers, sweepers, logging): python run.py --hydra-help"]
    # Hydra fills the template with string.Template: a literal $ must be doubled
    return "\n".join(out).replace("$", "$$") + "\n"


def register_resolver() -> None:
    if not OmegaConf.has_resolver("harness_help"):
        OmegaConf.register_new_resolver("harness_help", lambda: text())
