"""mrl: multi-reward RL for LLM agents.  The packages, top to bottom (pyproject.toml's import contract):

  cli.py, repro/    the commands and the reproductions
  overrides.py      the command line before Hydra
  train/            the RL loop and its phases, SFT, held-out evaluation
  runs/ generation/ envs/ rewards/
                    a run on disk; generating rollouts; the environments and what a task is; reward channels
  chat/ sandbox/ modeling/
                    conversations as tokens; running generated code; the policy and what trains it
  algo/             the trainers' maths
  core/             schemas, plain data, ranks

Modules moved into these packages on 2026-12-06 are still importable (and runnable with `python -m`) by their old
names (`mrl.advantages`, `mrl.protocols`, ...: MOVED below), as the same module objects.  Names renamed with the
move are not aliased (`HFEngine` is `InProcessEngine`; the step's functions take the settings built at the door,
not `cfg`: docs/design.md).  mrl's own code imports only the new names (tests/test_moved_names.py).
"""

import importlib
import importlib.abc
import importlib.util
import sys
import types

MOVED = {
    "mrl.config": "mrl.core.config",
    "mrl.bounded": "mrl.core.safe_json",
    "mrl.stats": "mrl.core.stats",
    "mrl.episode": "mrl.core.episode",
    "mrl.distributed": "mrl.core.distributed",
    "mrl.data": "mrl.core.data",
    "mrl.advantages": "mrl.algo.advantages",
    "mrl.shaping": "mrl.algo.shaping",
    "mrl.losses": "mrl.algo.losses",
    "mrl.algos": "mrl.algo.algos",
    "mrl.models": "mrl.modeling.models",
    "mrl.lora": "mrl.modeling.lora",
    "mrl.precision": "mrl.modeling.precision",
    "mrl.trainable": "mrl.modeling.trainable",
    "mrl.local_models": "mrl.modeling.local_models",
    "mrl.fits": "mrl.modeling.fits",
    "mrl.protocols": "mrl.chat.protocols",
    "mrl.chat_template": "mrl.chat.chat_template",
    "mrl.stops": "mrl.chat.stops",
    "mrl.rollout": "mrl.generation.rollout",
    "mrl.decoder": "mrl.generation.decoder",
    "mrl.captured": "mrl.generation.captured",
    "mrl.tasks": "mrl.envs.task",
    "mrl.rundir": "mrl.runs.rundir",
    "mrl.checkpoint": "mrl.runs.checkpoint",
    "mrl.restore": "mrl.runs.restore",
    "mrl.tracking": "mrl.runs.tracking",
    "mrl.warm_start": "mrl.runs.warm_start",
    "mrl.export": "mrl.runs.export",
    "mrl.report": "mrl.runs.report",
    "mrl.loop": "mrl.train.loop",
    "mrl.collect": "mrl.train.collect",
    "mrl.update": "mrl.train.update",
    "mrl.sft": "mrl.train.sft",
    "mrl.evaluate": "mrl.train.evaluate",
    "mrl.validation": "mrl.train.validation",
    "mrl.demonstrations": "mrl.train.demonstrations",
    "mrl.benchmarks": (),  # a module of its own: the import system sets its submodules on it, never on mrl.envs
    "mrl.benchmarks.bfcl": ("mrl.envs.bfcl.grader", "mrl.envs.bfcl_agent.gym"),  # BFCL's graders: grade, replay
    "mrl.benchmarks.humaneval": "mrl.envs.humaneval",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old name of a moved module as the module at its new home (one object under both names); a name
    whose parts went to several homes, as a module of their public names."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        home = MOVED[spec.name]
        if isinstance(home, str):
            module = importlib.import_module(home)
            spec.loader_state = module.__spec__  # the import system sets __spec__ to this one; exec_module restores it
            return module
        module = types.ModuleType(spec.name)
        module.__path__ = []  # a package, so that its old submodules import below it
        for part in map(importlib.import_module, home):
            module.__dict__.update((k, v) for k, v in vars(part).items() if not k.startswith("_"))
        return module

    def get_code(self, name):  # `python -m <old name>` runs the module at its home
        home = MOVED[name]
        return importlib.util.find_spec(home).loader.get_code(home) if isinstance(home, str) else None

    def exec_module(self, module):
        if module.__spec__.loader_state is not None:
            module.__spec__ = module.__spec__.loader_state


sys.meta_path.insert(0, _MovedModules())  # before any finder that could still see an old file
