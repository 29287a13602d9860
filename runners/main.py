"""One Hydra job: validate the config, resolve the model, measure every workload point, write
records and the table. `run.py` calls :func:`run_job`; tests call it through Hydra's compose API.
"""
from __future__ import annotations

import os
import signal
import sys
import uuid
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from omegaconf import DictConfig, OmegaConf

from systems.base import SystemUnavailable
from runners import identity, preflight, records, tables
from runners.serving import api_key
from runners.checkpoint import verify_checkpoint, verify_config_json
from runners.schema import Config, ConfigError, Isolation, Mode, validate
from runners.session import Job, Session, base_record, load_adapter_class
from runners.workloads import expand


class Interrupted(BaseException):
    """SIGINT/SIGTERM during a job (a BaseException so that measurement code cannot swallow it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def _signals_raise():
    def handler(signum, _frame):
        raise Interrupted(signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def resolve_model_path(conf: Config) -> str:
    model = conf.model
    if model.path:
        path = Path(model.path).expanduser()
        if not (path / "config.json").is_file():
            what = "does not exist" if not path.exists() else "has no config.json (not a Hugging Face checkpoint)"
            raise ConfigError(f"model.path={model.path!r} {what}")
        verify_config_json(path)
        verify_checkpoint(path)
        return str(path)
    if not model.synthetic:
        raise ConfigError(f"model={model.name} needs model.path=<local Hugging Face checkpoint> to execute "
                          f"(or mode=simulate, which needs no weights)")
    from runners.synthetic import ensure_synthetic_model

    path = ensure_synthetic_model(model.name, dict(model.arch), model.seed,
                                  Path(conf.cache_dir).expanduser() / "models", dtype=model.dtype.value)
    verify_config_json(path)  # a cached copy can be damaged too
    return str(path)


def _limits(conf: Config) -> list[str]:
    """The run.* limits this job sets; each needs a child process to be enforced."""
    return [f"run.{k}={getattr(conf.run, k):g}" for k in ("timeout_s", "load_timeout_s", "memory_limit_gb")
            if getattr(conf.run, k) is not None]


def prepare(cfg: DictConfig) -> tuple[Config, dict[str, Any]]:
    """Validate (keys, types, ranges, mode) before anything runs; raises ConfigError with a one-line reason."""
    conf = validate(cfg)
    if conf.run.isolation is Isolation.inline and _limits(conf):
        raise ConfigError(f"run.isolation=inline cannot enforce {', '.join(_limits(conf))}: limits need a child "
                          f"process; allowed: run.isolation=auto or process, or no limit")
    _check_adapter(conf.system.adapter)
    resolved = api_key.redact(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
    return conf, resolved


def _check_adapter(spec: str) -> None:
    """system.adapter names a SystemAdapter class (ConfigError otherwise), in either mode: simulate does not
    load it, but a value that could never run is refused the same way everywhere."""
    try:
        load_adapter_class(spec)
    except SystemUnavailable:  # its module lacks a dependency here: recorded as `skipped` when the job loads it
        pass


def run_job(cfg: DictConfig, run_dir: Path) -> list[dict[str, Any]]:
    """Measure the job's configurations; returns this job's records (also written to disk)."""
    # resume is decided on the config as asked (identity.py), before anything is detected or loaded
    requested = identity.requested_config(cfg)
    preflight.check_execute_environment(requested)  # before resume: a foreign environment never "resumes"
    run_dir = Path(run_dir)
    index_path = Path(requested["run"]["index_path"]).expanduser() if requested["run"]["index_path"] \
        else records.default_index_path()
    preflight.check_index_path(index_path)
    points = [p.as_dict() for p in expand(SimpleNamespace(**requested["workload"]))]
    hashes = [records.config_hash(requested, p) for p in points]
    resume = requested["run"]["resume"] and not requested["run"]["force"]
    oks = records.ok_records(index_path) if resume else []
    done = {rec["config_hash"]: rec for rec in oks}
    todo = [i for i, h in enumerate(hashes) if h not in done]
    _say_why_not_resumed(records.recorded_by_other_code(oks, requested, [points[i] for i in todo]))
    store = records.RunRecords(run_dir, index_path)
    if points and not todo:
        # Every configuration has an ok record of this code and this requested config, which passed
        # validation when it ran; so nothing is validated, detected (the bandwidth probe) or loaded.
        _add_resumed(store, done, hashes, len(points))
        _write_table(store.records, run_dir)
        return store.records

    conf, resolved = prepare(cfg)
    serving = bool(conf.workload.concurrency or conf.workload.rates)
    if serving and conf.mode is not Mode.execute:
        raise ConfigError(f"workload.concurrency={list(conf.workload.concurrency)}, workload.rates="
                          f"{list(conf.workload.rates)} (a serving workload) is measured against a running server; "
                          f"allowed: mode=execute")
    if serving and not conf.workload.ignore_eos:
        raise ConfigError("workload.ignore_eos=false is not measured: guidellm's synthetic requests always send "
                          "ignore_eos, so that each returns its output length; allowed: true")
    simulating = conf.mode is Mode.simulate  # no weights, no child process, the host's cores irrelevant
    if simulating:
        preflight.check_trace(conf, points)
    else:
        preflight.check_threads(conf)
        preflight.check_prompt_file(conf.workload.prompt_file)
    model_path = "" if simulating else resolve_model_path(conf)
    preflight.check_model_support(conf, lambda: _model_config(conf, model_path))
    _add_resumed(store, done, hashes, len(points))
    run_id = uuid.uuid4().hex[:12]

    try:
        process_env = {} if simulating else dict(load_adapter_class(conf.system.adapter).process_env)
    except SystemUnavailable:  # recorded as `skipped` when the job loads the system
        process_env = {}
    isolation = Isolation.inline if simulating else conf.run.isolation
    if isolation is Isolation.auto:
        # a fresh process when there is more than one configuration, when a limit must be enforced,
        # or when the system needs its environment set before torch loads (this process may have
        # loaded it already)
        isolation = Isolation.process if len(todo) > 1 or _limits(conf) or process_env else Isolation.inline
    if isolation is Isolation.inline and process_env:
        if "torch" in sys.modules:
            print(f"warning: run.isolation=inline: {process_env} cannot take effect (torch is already loaded)",
                  file=sys.stderr)
            process_env = {}
        else:
            os.environ.update(process_env)
    job = Job(config=resolved, model_path=model_path, run_id=run_id, points=points, hashes=hashes,
              isolation=isolation.value, process_env=process_env, system_config=conf.system,
              memory_limit_gb=conf.run.memory_limit_gb,
              detected=identity.detected(requested, resolved), run_dir=str(run_dir))
    progress = _Progress(job, todo, enabled=conf.run.progress)
    current: list[int | None] = [None]
    try:
        with _signals_raise():
            for record in _measure(job, todo, conf, progress, current):
                progress.done(store.add(record))
    except Interrupted as exc:
        if current[0] is not None:
            store.add(base_record(job, current[0], "interrupted", f"received {exc}"))
        progress.close()
        _write_table(store.records, run_dir)
        where = f"finished records are in {store.path}" if store.path.exists() else \
            "no configuration had finished, nothing was recorded"
        print(f"interrupted by {exc}; {where}", file=sys.stderr)
        sys.exit(128 + exc.signum)
    progress.close()
    _write_table(store.records, run_dir)
    return store.records


def _model_config(conf: Config, model_path: str):
    """The model's fiddler MoEConfig: from its checkpoint's config.json, or (simulate) from model.arch."""
    if not model_path:
        from runners.simulate import model_config

        return model_config(dict(conf.model.arch))
    from fiddler.config import MoEConfig

    return MoEConfig.from_pretrained(model_path)


def _add_resumed(store: records.RunRecords, done: dict[str, dict[str, Any]], hashes: list[str], n: int) -> None:
    resumed = [h for h in hashes if h in done]
    for h in resumed:
        store.add({**done[h], "resumed_from": done[h]["run_id"]}, to_index=False)
    if resumed:
        print(f"resume: {len(resumed)} of {n} configurations already have an ok record "
              f"(run.force=true re-runs them)", file=sys.stderr)


def _say_why_not_resumed(other: dict[str, int]) -> None:
    if other:
        which = ", ".join(f"{n} at {v}" for v, n in sorted(other.items()))
        print(f"resume: not resumed: ok records of these configurations from other code ({which}); a configuration "
              f"is identified by its config and the code's commit (runners/records.py config_hash), so a sweep "
              f"resumes only at the commit it was recorded at", file=sys.stderr)


def _measure(job: Job, todo: list[int], conf: Config, progress, current: list):
    if conf.workload.concurrency or conf.workload.rates:  # a serving workload: guidellm against the system's server
        from runners.serving.workload import measure_all

        yield from measure_all(job, todo, conf, progress, current)
        return
    if conf.mode is Mode.simulate:
        from runners.simulate import measure_all

        yield from measure_all(job, todo, progress, current)
        return
    if job.isolation == "process":
        from runners.isolation import run_isolated

        def on_event(kind, payload):
            if kind == "start":
                current[0] = payload
                progress.start(payload)
            elif kind == "progress":
                progress.note(payload)
        for record in run_isolated(job, todo, timeout_s=conf.run.timeout_s,
                                   load_timeout_s=conf.run.load_timeout_s, on_event=on_event):
            current[0] = None
            yield record
        return
    session = Session(job, on_progress=progress.note)
    progress.note("loading system")
    session.load()
    try:
        for index in todo:
            current[0] = index
            progress.start(index)
            record = session.measure(index)
            current[0] = None
            yield record
    finally:
        session.close()


def _write_table(recs: list[dict[str, Any]], run_dir: Path) -> None:
    if not recs:
        return
    table = tables.build(recs)
    tables.save(table, run_dir)
    print(tables.to_markdown(table))


class _Progress:
    """A tqdm bar over configurations (stderr), with the current phase as postfix."""

    def __init__(self, job: Job, todo: list[int], enabled: bool):
        self.job = job
        self.bar = None
        if enabled and todo:
            from tqdm import tqdm

            self.bar = tqdm(total=len(todo), desc=f"{job.system['name']}/{job.config['workload']['name']}",
                            unit="cfg", file=sys.stderr, dynamic_ncols=True)

    def start(self, index: int) -> None:
        if self.bar:
            p = self.job.points[index]
            self.bar.set_postfix_str(f"in={p['input_len']} out={p['output_len']} beam={p['beam_width']}")

    def note(self, msg: str) -> None:
        if self.bar:
            self.bar.set_postfix_str(msg)

    def done(self, record: dict[str, Any]) -> None:
        if self.bar:
            self.bar.update(1)
            if record["status"] != "ok":
                self.bar.write(f"{record['status']}: {record['point']} {record.get('reason')}")

    def close(self) -> None:
        if self.bar:
            self.bar.close()
            self.bar = None


def failures(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in recs if r["status"] not in ("ok", "skipped")]

