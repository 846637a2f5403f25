"""Checkpoint formats as plugins (memtrain/checkpoint/formats/) and the one manifest reader
(memtrain/checkpoint/layout.read_manifest): the manifest's checkpoint_format decides how weights
are read, never the engine that wrote them; manifests from before the field still read."""

from __future__ import annotations

import json

import pytest
import torch

from memtrain.checkpoint.formats import FORMATS, CheckpointState, SavedRun, dcp, format_module, read_full_weights, safetensors
from memtrain.checkpoint.layout import read_manifest
from memtrain.errors import CheckpointError, ConfigError
from memtrain.memory.shape import model_shape


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


@pytest.mark.parametrize("name", ["safetensors", "dcp"])
def test_each_format_reads_back_the_weights_it_wrote_without_a_process_group(tmp_path, name):
    """Saved by the format's own ``save`` in one process, read by ``read_full_weights`` through the
    manifest's ``checkpoint_format`` (the manifest's engine name is deliberately another one)."""
    net = model()
    optimizer = torch.optim.AdamW(net.parameters())
    net(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    format_module(name).save(CheckpointState(net, optimizer), str(tmp_path))
    weights = read_full_weights(str(tmp_path), {"checkpoint_format": name, "backend": "deepspeed"})
    assert weights.keys() == net.state_dict().keys()
    assert all(torch.equal(weights[k], v) for k, v in net.state_dict().items())


def test_an_unknown_format_is_refused_by_name(tmp_path):
    from pathlib import Path

    import memtrain.checkpoint.formats as package

    modules = sorted(p.stem for p in Path(package.__file__).parent.glob("*.py") if not p.stem.startswith("_"))
    assert list(FORMATS) == modules and {"dcp", "deepspeed", "safetensors"} <= set(FORMATS)  # the package's modules
    with pytest.raises(CheckpointError, match=f"'zip' is not one of {', '.join(FORMATS)}$"):
        format_module("zip")
    with pytest.raises(CheckpointError, match="names no checkpoint_format"):
        read_full_weights(str(tmp_path), {})


def test_manifests_from_before_formats_and_specs_read_with_both(tmp_path):
    """A manifest written before ``checkpoint_format`` and ``engine_spec`` existed gets both (from
    its engine and its config's backend section); the file is not changed."""
    old = {"format": 2, "backend": "fsdp", "step": 4, "world_size": 2,
           "config": {"backend": {"name": "auto", "offload": "optimizer_and_params", "zero_stage": None}}}
    (tmp_path / "manifest.json").write_text(json.dumps(old))
    manifest = read_manifest(str(tmp_path))
    assert manifest["checkpoint_format"] == "dcp"
    assert manifest["engine_spec"]["name"] == "fsdp" and manifest["engine_spec"]["offload"] == "optimizer_and_params"
    assert json.loads((tmp_path / "manifest.json").read_text()) == old
    for engine, written in (("ddp", "safetensors"), ("deepspeed", "deepspeed"), ("another", None)):
        (tmp_path / "manifest.json").write_text(json.dumps({**old, "backend": engine}))
        assert read_manifest(str(tmp_path)).get("checkpoint_format") == written
    with pytest.raises(CheckpointError, match="missing does not exist"):
        read_manifest(str(tmp_path / "missing"))


@pytest.mark.parametrize("loader", ["set_state_dict", "as_read"])
@pytest.mark.parametrize("name", ["safetensors", "dcp"])
def test_full_state_is_keyed_by_name_and_loads_into_another_model(tmp_path, name, loader):
    """``read_full_state`` gives the weights and the optimizer state keyed by parameter name;
    loaded into a fresh model and optimizer through torch's state-dict API (a switch to FSDP2 with
    an offload) or ``load_full_state_as_read`` (to DDP, or FSDP2 without offload), the next
    optimizer step matches the original's exactly: Adam's moments and step count came across.
    ``load_full_state_as_read`` never steps the optimizer (torch's steps once on zero gradients to
    build a state it then replaces: the moments twice and a gradient per parameter), and keeps the
    read tensors as the optimizer's state. The format's ``full_state_read_bytes`` (the engine
    switch's resume moment) is the bytes of the tensors ``read_full_state`` returned."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    from memtrain.backends.common import load_full_state_as_read

    def trained():
        net = model()
        opt = torch.optim.AdamW([{"params": [p for p in net.parameters() if p.ndim >= 2], "weight_decay": 0.1},
                                 {"params": [p for p in net.parameters() if p.ndim < 2], "weight_decay": 0.0}])
        return net, opt

    def step(net, opt):
        opt.zero_grad()
        net(torch.arange(12.0).reshape(3, 4)).pow(2).sum().backward()
        opt.step()

    net, opt = trained()
    for _ in range(2):
        step(net, opt)
    format_module(name).save(CheckpointState(net, opt), str(tmp_path))
    fresh, fresh_opt = trained()
    weights, optim = format_module(name).read_full_state(str(tmp_path), fresh)
    assert set(optim["state"]) == {n for n, _ in net.named_parameters()}
    # what the engine switch's moment counts the read as: the bytes of the tensors it returned
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*weights.values(), *(v for s in optim["state"].values() for k, v in s.items() if k != "step")]}
    read_bytes, read_peak = format_module(name).full_state_read_bytes(model_shape(fresh), SavedRun(world_size=1))
    assert read_bytes == sum(storages.values()) and read_peak >= read_bytes
    steps, fresh_step = [], fresh_opt.step
    fresh_opt.step = lambda *a, **k: steps.append(1) or fresh_step(*a, **k)
    if loader == "as_read":
        read = {n: s["exp_avg"] for n, s in optim["state"].items()}
        load_full_state_as_read(fresh, fresh_opt, weights, optim)
        assert not steps
        assert all(fresh_opt.state[p]["exp_avg"] is read[n] for n, p in fresh.named_parameters())
    else:
        set_state_dict(fresh, fresh_opt, model_state_dict=weights, optim_state_dict=optim,
                       options=StateDictOptions(full_state_dict=True))
        assert steps == [1]
    step(net, opt)
    step(fresh, fresh_opt)
    for (n, a), b in zip(net.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), n


def test_a_load_as_read_refuses_other_groups_and_weights_by_name(tmp_path):
    """A switch to DDP whose optimizer groups the parameters otherwise, or whose weights miss an
    entry, is refused with what differs; a tied parameter loaded under one of its names is not
    missing."""
    from memtrain.backends.common import load_full_state_as_read

    net = model()
    opt = torch.optim.AdamW(net.parameters())
    safetensors.save(CheckpointState(net, opt), str(tmp_path))
    weights, optim = safetensors.read_full_state(str(tmp_path), net)
    split = torch.optim.AdamW([{"params": list(net.parameters())[:2]}, {"params": list(net.parameters())[2:]}])
    with pytest.raises(CheckpointError, match="parameter group 0 holds other parameters"):
        load_full_state_as_read(net, split, weights, optim)
    with pytest.raises(CheckpointError, match=r"missing \['2.bias'\]"):
        load_full_state_as_read(net, opt, {k: v for k, v in weights.items() if k != "2.bias"}, optim)
    tied = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False))
    tied[1].weight = tied[0].weight
    tied_opt = torch.optim.AdamW(tied.parameters())
    load_full_state_as_read(tied, tied_opt, {"0.weight": torch.ones(4, 4)},
                               {"state": {}, "param_groups": [{**tied_opt.param_groups[0], "params": ["0.weight"]}]})
    assert torch.equal(tied[1].weight, torch.ones(4, 4))


def test_an_export_stores_a_tied_parameter_once_however_it_was_gathered(tmp_path):
    """A state dict whose tied names hold copies of their own (as FSDP2's full state dict gives
    them, and a compiled module's names carry ``_orig_mod.``) is exported with GPT-2's head and
    embedding stored once, as transformers saves the model itself; the caller's dict is untouched."""
    from safetensors import safe_open
    from transformers import GPT2Config, GPT2LMHeadModel

    from memtrain.export import export_model
    from memtrain.weights import share_tied

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=32, n_positions=16))
    copies = {k: v.clone() for k, v in gpt2.state_dict().items()}  # each name a tensor of its own
    compiled = torch.nn.Module()
    compiled._orig_mod = gpt2  # torch.compile's wrapper names the parameters so
    shared = share_tied(compiled, copies)
    assert shared["lm_head.weight"] is shared["transformer.wte.weight"]
    assert copies["lm_head.weight"] is not copies["transformer.wte.weight"]
    export_model(gpt2, copies, str(tmp_path / "model"))
    with safe_open(str(tmp_path / "model" / "model.safetensors"), "pt") as fh:
        names = set(fh.keys())
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names


def test_a_checkpoint_of_another_format_is_predicted_as_an_engine_switch():
    """A run resumes another format's checkpoint the way it resumes another engine's (read whole):
    its resume moment is the switch's when the engine differs or the format differs from the one
    the run writes (``checkpoint.format``, ``auto``: the engine's own), and its own load's otherwise."""
    from types import SimpleNamespace

    from memtrain.planning.resumed import with_resumed_switch

    state = {"held_bytes": 1000}
    run = lambda fmt: SimpleNamespace(checkpoint=SimpleNamespace(format=fmt))  # noqa: E731
    saved_by_ddp = (("ddp", "safetensors"), 300, 400)
    assert with_resumed_switch(state, run("auto"), "ddp", saved_by_ddp) == state  # its own format
    assert with_resumed_switch(state, run("safetensors"), "ddp", saved_by_ddp) == state
    switched = with_resumed_switch(state, run("dcp"), "ddp", saved_by_ddp)
    assert (switched["switch_read_bytes"], switched["switch_read_peak_bytes"]) == (300, 400)
    assert "switch_read_bytes" in with_resumed_switch(state, run("auto"), "fsdp", saved_by_ddp)  # another engine
    assert with_resumed_switch(state, run("auto"), "fsdp", (("fsdp", "dcp"), 300, 400)) == state


def test_the_switch_read_is_sized_from_what_the_manifest_says_of_the_saving_run():
    """``SavedRun.of`` takes from a manifest what the read sizes depend on: the saving world size,
    the ZeRO stage, a DeepSpeed run's 16-bit module weights under bf16, the moments' dtype, whether
    the model was saved sharded; what a manifest leaves out is taken at its largest (fp32, one
    rank, whole tensors). DeepSpeed's conversion reads one rank's optimizer file at a time, so
    fewer saving ranks make a larger read peak; dcp's read holds two stored pieces beside what it
    returns: two whole parameters, or two shards (one parameter on 2 ranks)."""
    from memtrain.memory.shape import ModelShape

    ds = SavedRun.of({"backend": "deepspeed", "world_size": 4, "zero_stage": 2, "config": {"precision": "bf16"}})
    assert (ds.world_size, ds.zero_stage, ds.parameter_element_bytes, ds.state_element_bytes) == (4, 2, 2, 4)
    bf16_moments = SavedRun.of({"backend": "ddp", "world_size": 2, "engine_spec": {"optimizer_state_dtype": "bf16"}})
    assert (bf16_moments.parameter_element_bytes, bf16_moments.state_element_bytes) == (4, 2)
    assert SavedRun.of({}) == SavedRun(world_size=1)
    fsdp = SavedRun.of({"backend": "fsdp", "world_size": 2, "checkpoint_model": "sharded_module"})
    assert fsdp.sharded and not bf16_moments.sharded
    shape = ModelShape(parameters=1000, largest_module=400, numels=(400, 300, 300))
    assert safetensors.full_state_read_bytes(shape, SavedRun(1)) == (12_000, 12_000)
    assert safetensors.full_state_read_bytes(shape, bf16_moments)[0] == 8_000
    assert dcp.full_state_read_bytes(shape, SavedRun(1)) == (12_000, 12_000 + 2 * 4 * 400)
    assert dcp.full_state_read_bytes(shape, fsdp) == (12_000, 12_000 + 4 * 400)
    deepspeed = format_module("deepspeed")
    one, four = (deepspeed.full_state_read_bytes(shape, SavedRun(n, 2)) for n in (1, 4))
    assert one[0] == four[0] == 12_000 and one[1] == 4 * 1000 + 12 * 1000 > four[1] == 12_000 + 4 * 400


def test_an_engine_writes_and_reads_through_the_format_it_is_handed(tmp_path):
    """The format is handed to the engine when it is built (``make_backend``), not imported by it:
    DDP handed ``dcp`` in place of its own ``safetensors`` writes dcp's files, names dcp in its
    manifest, and loads them back into a fresh model and optimizer exactly; a format that does not
    save the model as the engine holds it (its ``SAVES``) is refused by name."""
    from conftest import TINY_ARGS

    from memtrain.backends import make_backend
    from memtrain.config import parse_args
    from memtrain.distributed import ProcessState
    from memtrain.plan import Plan
    from memtrain.planning.run_placement import configured_spec

    process = ProcessState(cpu=True)
    try:
        def built(checkpoint_format):
            cfg = parse_args(TINY_ARGS + ["--backend.name", "ddp", "--checkpoint.format", checkpoint_format])
            backend = make_backend(cfg, configured_spec(cfg, 1), process, "fp32", Plan(2, 1))
            net, opt = backend.prepare(model(), lambda m: torch.optim.AdamW(m.parameters(), lr=0.1))
            return backend, net, opt

        assert built("auto")[0].checkpoint_io.NAME == "safetensors"  # the engine's own
        backend, net, opt = built("dcp")
        net(torch.ones(3, 4)).pow(2).sum().backward()
        opt.step()
        backend.save_state(net, opt, str(tmp_path))
        assert backend.manifest_fields()["checkpoint_format"] == "dcp"
        assert backend.expected_files() == dcp.expected_files(CheckpointState(None, world_size=1))
        assert (tmp_path / "dcp" / ".metadata").exists() and not list(tmp_path.glob("*.safetensors"))
        _, fresh, fresh_opt = built("dcp")
        backend.load_state(fresh, fresh_opt, str(tmp_path), 1)
        assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), fresh.state_dict().values()))
        saved, loaded = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
        assert all(torch.equal(saved[i]["exp_avg_sq"], loaded[i]["exp_avg_sq"]) for i in saved)
        with pytest.raises(ConfigError, match="'deepspeed' cannot be written by engine ddp: choose auto or dcp, safetensors"):
            built("deepspeed")  # a format the engine cannot write through is refused when it is built
        fsdp = parse_args(TINY_ARGS + ["--backend.name", "fsdp", "--checkpoint.format", "safetensors"])
        with pytest.raises(ConfigError, match="'safetensors' cannot be written by engine fsdp: choose auto or dcp$"):
            make_backend(fsdp, configured_spec(fsdp, 1), process, "fp32", Plan(2, 1))  # its sharded module: dcp only
        # a checkpoint in another format than the engine's own is read as another engine's: its whole state
        from memtrain.checkpoint.stateful import EngineState

        own, fresh, fresh_opt = built("auto")
        manifest = {"backend": "ddp", "checkpoint_format": "dcp", "world_size": 1,
                    **{k: v for k, v in EngineState(backend, net, opt).prepare_save(1).items() if k == "model_shapes"}}
        EngineState(own, fresh, fresh_opt).load_files(str(tmp_path), manifest)
        assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), fresh.state_dict().values()))
    finally:
        process.close()


class StandInFormat:
    """A stand-in format, registered only in these tests: the whole state in one ``state.pt``,
    rank 0 writes it, for a model every rank holds whole. It names no engine."""

    NAME = "stand_in"
    FILE = "state.pt"

    def __init__(self):
        from memtrain.checkpoint.formats import WHOLE_MODULE

        self.SAVES = (WHOLE_MODULE,)

    def expected_files(self, state):
        return [self.FILE]

    def staging_bytes(self, optimizer_bytes, largest_tensor_bytes=0, async_save=False):
        return optimizer_bytes  # torch.save copies the whole state to the host

    def save(self, state, directory, process_group=None, async_save=False):
        if state.writes:
            torch.save({"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict()},
                       f"{directory}/{self.FILE}")

    def load(self, state, directory, process_group=None):
        saved = torch.load(f"{directory}/{self.FILE}", map_location="cpu", weights_only=True)
        state.model.load_state_dict(saved["model"])
        state.optimizer.load_state_dict(saved["optimizer"])

    def read_full_weights(self, path):
        return torch.load(f"{path}/{self.FILE}", map_location="cpu", weights_only=True)["model"]


def test_a_new_format_registered_alone_is_handed_to_every_engine_holding_what_it_saves(tmp_path, monkeypatch):
    """A format is its module and nothing else: registered as the package's scan would find it,
    DDP (whose model it saves) is handed it, writes and reads it back exactly, and export reads its
    weights; FSDP2, whose sharded module it does not save, is refused it by name."""
    import sys

    import memtrain.checkpoint.formats as package
    from conftest import TINY_ARGS
    from memtrain.backends import make_backend
    from memtrain.config import parse_args
    from memtrain.distributed import ProcessState
    from memtrain.plan import Plan
    from memtrain.planning.run_placement import configured_spec

    monkeypatch.setattr(package, "FORMATS", tuple(sorted(package.FORMATS + ("stand_in",))))
    monkeypatch.setitem(sys.modules, "memtrain.checkpoint.formats.stand_in", StandInFormat())
    cfg = parse_args(TINY_ARGS + ["--backend.name", "ddp", "--checkpoint.format", "stand_in"])
    process = ProcessState(cpu=True)
    try:
        def built():
            backend = make_backend(cfg, configured_spec(cfg, 1), process, "fp32", Plan(2, 1))
            return (backend, *backend.prepare(model(), lambda m: torch.optim.AdamW(m.parameters(), lr=0.1)))

        backend, net, opt = built()
        net(torch.ones(3, 4)).pow(2).sum().backward()
        opt.step()
        backend.save_state(net, opt, str(tmp_path))
        assert backend.manifest_fields()["checkpoint_format"] == "stand_in" and backend.expected_files() == ["state.pt"]
        _, fresh, fresh_opt = built()
        backend.load_state(fresh, fresh_opt, str(tmp_path), 1)
        assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), fresh.state_dict().values()))
        assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
        weights = read_full_weights(str(tmp_path), {"checkpoint_format": "stand_in"})
        assert all(torch.equal(weights[k], v) for k, v in net.state_dict().items())
        fsdp = parse_args(TINY_ARGS + ["--backend.name", "fsdp", "--checkpoint.format", "stand_in"])
        with pytest.raises(ConfigError, match="'stand_in' cannot be written by engine fsdp: choose auto or dcp$"):
            make_backend(fsdp, configured_spec(fsdp, 1), process, "fp32", Plan(2, 1))
    finally:
        process.close()
    # planned too: the placement pool holds the engines it saves, and a save stages what it says
    import dataclasses

    from memtrain.planning.placement import plan_placements, planning_pool
    from test_placement import SHAPE, candidates, machine

    def planned(checkpoint_format):
        pool = planning_pool(parse_args(["--backend.offload", "auto", "--checkpoint.format", checkpoint_format]), False)
        no_export = dataclasses.replace(machine(), exports=False)
        return pool, plan_placements(candidates(), pool[:1], SHAPE, "bf16", 1, no_export)[0].host_bytes

    pool, host = planned("stand_in")
    assert {p.engine for p in pool} == {"ddp"} and {p.checkpoint_format for p in pool} == {"stand_in"}
    assert host == planned("safetensors")[1] > planned("dcp")[1]  # both stage the whole optimizer state


def test_the_dcp_read_peak_is_what_memtracker_counts_for_whole_tensors(tmp_path):
    """A dcp checkpoint of a model saved whole (DDP's, or any rank's whole module) read back in one
    process: MemTracker's peak of what ``read_full_state`` allocates is the format's predicted
    read peak (``full_state_read_bytes``, within 1%), which holds two whole fp32 parameters beside
    the state it returns; the read peak of a sharded save (one parameter) is under it."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from memtrain.memory.shape import model_shape

    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(net.parameters())
    net(torch.ones(2, 64)).sum().backward()
    opt.step()
    dcp.save(CheckpointState(net, opt), str(tmp_path))
    tracker = MemTracker()
    with tracker:
        dcp.read_full_state(str(tmp_path), net)
    counted = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    _, predicted = dcp.full_state_read_bytes(model_shape(net), SavedRun(world_size=1))
    assert abs(predicted - counted) <= 0.01 * counted, (predicted, counted)
    _, one_piece = dcp.full_state_read_bytes(model_shape(net), SavedRun(world_size=1, sharded=True))
    assert one_piece < 0.95 * counted  # one parameter in flight would be under


def test_a_manifest_from_before_checkpoint_model_is_read_with_its_engines(monkeypatch):
    """A manifest written before manifests named ``checkpoint_model`` is sized with the model its
    engine hands every format: FSDP2's dcp checkpoint as saved sharded (one parameter in flight,
    as before the field existed), DDP's dcp checkpoint as saved whole (two)."""
    from conftest import TINY_ARGS
    from memtrain.config import parse_args
    from memtrain.memory.shape import ModelShape
    from memtrain.planning import resumed

    shape = ModelShape(parameters=1000, largest_module=400, numels=(400, 300, 300))
    cfg = parse_args(TINY_ARGS)

    def read(backend):
        monkeypatch.setattr(resumed, "resumed_manifest",
                            lambda cfg: {"backend": backend, "checkpoint_format": "dcp", "world_size": 2})
        (saved_by, _), read_bytes, peak = resumed.switch_read(cfg, shape)
        assert saved_by == backend and read_bytes == 12_000
        return peak - read_bytes

    assert read("fsdp") == 4 * 400 and read("ddp") == 2 * 4 * 400
