"""Runs __main__.py under Pulumi's mocks and records what every resource received.

The real Pulumi SDK and provider classes run; only the engine is a mock, as in Pulumi's
unit-testing guide. Config is set first, then the mocks, then the program.
"""

from __future__ import annotations

import runpy
from dataclasses import dataclass, field
from pathlib import Path

import pulumi
from google.protobuf import json_format
from pulumi.runtime import mocks as pulumi_mocks
from pulumi.runtime.stack import run_pulumi_func
from pulumi.runtime.sync_await import _sync_await

ROOT = Path(__file__).resolve().parent.parent
PROJECT_NUMBER = "123456789012"
DIGEST = "sha256:" + "ab" * 32
SECRET_SIG = "4dabf18193072939515e22adb298388d"
TOKEN = "hf_unitTestTokenValue0123456789"


@dataclass
class Registered:
    type: str
    name: str
    inputs: dict
    raw: dict  # the request as the engine receives it, secrets still wrapped
    dependencies: list[str] = field(default_factory=list)  # the URNs it waits for
    replace_on_changes: list[str] = field(default_factory=list)  # the options the engine diffs and replaces by
    delete_before_replace: bool = False


class StackMocks(pulumi_mocks.Mocks):
    def new_resource(self, args: pulumi_mocks.MockResourceArgs):
        state = dict(args.inputs)
        if args.typ == "gcp:container/cluster:Cluster":
            state |= {"endpoint": "203.0.113.10", "masterAuth": {"clusterCaCertificate": "Q0EtQ0VSVA=="}}
        elif args.typ == "docker:index/image:Image":
            state |= {"repoDigest": args.inputs["imageName"].rsplit(":", 1)[0] + "@" + DIGEST}
        elif args.typ == "pulumi-python:dynamic:Resource" and args.name == "training":
            storage = args.inputs["settings"]["storage_path"]
            ckpt = f"{storage}/sft-run/checkpoint_2026-12-02_10-00-00.000000"
            state |= {
                "checkpoint": ckpt,
                "checkpoints": [ckpt],
                "metrics": {"epoch": 3, "loss": 2.2},
                "loss_curve": f"{storage}/sft-run/loss.png",
                "data_report": {"train": {"records_used": 1024}},
                "collectives": {"ok": True},
                "job_ids": {"collectives": "c-a1", "finetune": "f-a1"},
                "slice_hours": 0.1,
                "run_hours": 0.5,
                "evaluation": {"tasks": {"heldout_loss": {"samples": 5, "metrics": {
                    "loss": {"base": 2.6, "fine_tuned": 2.31, "delta": -0.29}}}}},
            }  # fmt: skip
        elif args.typ == "pulumi-python:dynamic:Resource" and args.name == "served-evaluation":
            state |= {"scores": [{"task": "heldout_loss", "metric": "loss", "run": 2.31, "here": 2.3102}],
                      "problems": [], "job_id": "s-a1", "seconds": 1800.0}  # fmt: skip
        elif args.typ == "gcp:storage/bucket:Bucket":
            state |= {"url": f"gs://{args.inputs['name']}"}
        return f"{args.name}-id", state

    def call(self, args: pulumi_mocks.MockCallArgs):
        if args.token == "gcp:organizations/getProject:getProject":
            return {"number": PROJECT_NUMBER, "projectId": args.args.get("projectId")}
        if args.token == "gcp:organizations/getClientConfig:getClientConfig":
            return {"accessToken": "ya29.mock-access-token", "project": "p"}
        return {}


class RecordingMonitor(pulumi_mocks.MockMonitor):
    def __init__(self, mocks):
        super().__init__(mocks)
        self.registered: list[Registered] = []

    def RegisterResource(self, request):
        response = super().RegisterResource(request)
        if request.type != "pulumi:pulumi:Stack":
            inputs = pulumi.runtime.rpc.deserialize_properties(request.object)
            raw = json_format.MessageToDict(request.object)
            self.registered.append(Registered(request.type, request.name, inputs, raw, list(request.dependencies),
                                              list(request.replaceOnChanges), request.deleteBeforeReplace))  # fmt: skip
        return response


@dataclass
class Run:
    resources: list[Registered]
    outputs: dict = field(default_factory=dict)
    secret_outputs: set = field(default_factory=set)

    def of_type(self, type_: str, name: str | None = None) -> list[Registered]:
        return [r for r in self.resources if r.type == type_ and (name is None or r.name == name)]

    def one(self, type_: str, name: str | None = None) -> Registered:
        found = self.of_type(type_, name)
        assert len(found) == 1, f"{type_}: {len(found)} registered"
        return found[0]

    @property
    def types(self) -> list[str]:
        return sorted(r.type for r in self.resources)


def wire(value) -> str:
    """A config value as the program reads it: `pulumi.Config().get` returns strings, true/false for booleans."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def as_cli(raw: dict[str, str], prefix: str = "") -> dict[str, str]:
    """`raw` as the Pulumi CLI hands it to the program: every key Pulumi.yaml declares with a default, and
    the stack does not set, set to that default (../shared/FACTS.md; pulumi/pulumi sdk/go/common/workspace,
    mergeConfig). Every stack test gets its config through here."""
    from infra.config.stack import declared_keys

    defaults = {f"{prefix}{k}": wire(d["default"]) for k, d in declared_keys().items() if "default" in d}
    return defaults | {k: v for k, v in raw.items() if v is not None}


def parse_as_cli(raw: dict[str, str], *, stack: str = "v6e", project: str | None = "p", region: str | None = None,
                 zone: str | None = "us-east5-b", has_token: bool = True):  # fmt: skip
    """infra.config.stack.parse on `raw` with the CLI's defaults applied."""
    from infra.config import stack as config

    return config.parse(as_cli(raw), stack=stack, project=project, region=region, zone=zone, has_token=has_token)


def stack_config(stack: str, **overrides: str | None) -> dict[str, str]:
    """The stack file's settings plus what a user sets (project, region, zone, token), with the defaults
    the CLI applies."""
    import yaml

    values = yaml.safe_load((ROOT / f"Pulumi.{stack}.yaml").read_text())["config"]
    values |= {
        "gcp:project": "demo-project",
        "gcp:region": "us-east5",
        "gcp:zone": "us-east5-b",
        "gemma-tpu:hfToken": TOKEN,
    }
    for key, value in overrides.items():
        full = key if ":" in key else f"gemma-tpu:{key}"
        if value is None:
            values.pop(full, None)
        else:
            values[full] = value
    return as_cli({k: wire(v) for k, v in values.items()}, prefix="gemma-tpu:")


def run_program(stack: str, config: dict[str, str]) -> Run:
    pulumi.runtime.set_all_config(config, ["gemma-tpu:hfToken"])
    # A new stack each run: set_mocks keeps the root resource of an earlier run in this thread, outputs and all
    # (pulumi/runtime/mocks.py, set_mocks: a Stack only `if get_root_resource() is None`).
    from pulumi.runtime.settings import ROOT as root_resource

    root_resource.set(None)
    mocks = StackMocks()
    monitor = RecordingMonitor(mocks)
    pulumi.runtime.set_mocks(mocks, project="gemma-tpu", stack=stack, preview=False, monitor=monitor)
    run = Run(monitor.registered)
    run_program.last_registered = monitor.registered

    def program():
        runpy.run_path(str(ROOT / "__main__.py"), run_name="__main__")
        for name, value in pulumi.runtime.get_root_resource().outputs.items():
            output = pulumi.Output.from_input(value)
            run.outputs[name] = _sync_await(output.future())
            if _sync_await(output.is_secret()):
                run.secret_outputs.add(name)

    _sync_await(run_pulumi_func(program))
    return run
