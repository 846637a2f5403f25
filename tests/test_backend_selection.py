"""Engine choice from the config and the launcher, and the DeepSpeed JSON reconciliation."""

import json

import pytest

from memtrain.backends import infer_backend_name
from memtrain.backends.deepspeed import build_ds_config
from memtrain.config import ConfigError

from conftest import REPO, _free_port

PLAN = dict(global_batch_size=16, micro_batch_size=2, gradient_accumulation_steps=4, max_grad_norm=1.0,
            precision="fp32", precision_requested="fp32", zero_stage=None, offload=None)


@pytest.mark.parametrize("env,ds,expected", [
    ({}, None, "ddp"),
    ({"ACCELERATE_USE_FSDP": "true"}, None, "fsdp"),
    ({"ACCELERATE_USE_DEEPSPEED": "true"}, None, "deepspeed"),
    ({}, "ds_configs/zero2.json", "deepspeed"),
])
def test_auto_follows_the_launcher(monkeypatch, env, ds, expected):
    for k in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert infer_backend_name("auto", ds) == expected
    assert infer_backend_name("ddp", ds) == "ddp"  # an explicit choice wins


def test_a_zero_stage_under_auto_is_deepspeed_and_refused_under_an_fsdp_launcher(monkeypatch):
    """``--backend.zero_stage 3`` with ``backend.name auto`` (the default) runs DeepSpeed ZeRO-3,
    where the stage used to be dropped silently and the run trained DDP; under ``accelerate
    launch`` with an FSDP config it is refused (exit 2), naming the field and the engine."""
    from memtrain.backends.spec import resolve_engine
    from memtrain.config import parse_args
    from memtrain.validation import _validate_values

    for k in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(k, raising=False)
    cfg = parse_args(["--config", str(REPO / "recipes" / "code_lm_tiny.yaml"), "--backend.zero_stage", "3",
                      "--backend.offload", "optimizer"])  # offload: refused for DDP, as it was here before
    _validate_values(cfg)
    spec = resolve_engine(cfg.backend, world_size=1, rank=0)
    assert (spec.name, spec.zero_stage, spec.offload) == ("deepspeed", 3, "optimizer")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ConfigError, match=r"'backend.zero_stage'.*engine is 'fsdp' \(backend.name auto, launched"):
        _validate_values(cfg)



def test_the_spec_folds_the_deepspeed_json_in_and_the_engine_builds_what_it_says(tmp_path):
    """The user's DeepSpeed JSON is read once (``configured_engine``) and its stage, offload and
    partial-offload ratio become the spec's fields: no field means "whatever the JSON says", and the
    DeepSpeed config the engine builds from the spec's JSON holds the same values. The config's own
    settings win; the spec's JSON stays out of ``summary.json`` and the manifests (``as_dict``)."""
    from memtrain.backends.spec import configured_engine, resolve_engine
    from memtrain.config import parse_args

    path = tmp_path / "partial.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "reduce_bucket_size": 1000,
                                                      "offload_optimizer": {"device": "cpu", "ratio": 0.25}}}))
    cfg = parse_args(["--config", str(REPO / "recipes" / "code_lm_tiny.yaml"), "--backend.deepspeed_config", str(path)])
    spec = resolve_engine(cfg.backend, world_size=2, rank=1)
    assert (spec.name, spec.zero_stage, spec.offload, spec.offload_optimizer_ratio) == ("deepspeed", 3, "optimizer", 0.25)
    assert configured_engine(cfg.backend).zero_settings == {"reduce_bucket_size": 1000}
    assert "deepspeed_json" not in spec.as_dict() and json.dumps(spec.as_dict())
    built = build_ds_config(dict(spec.deepspeed_json), str(path), **{**PLAN, "zero_stage": spec.zero_stage,
                            "offload": spec.offload, "offload_optimizer_ratio": spec.offload_optimizer_ratio})
    assert built["zero_optimization"]["stage"] == 3 and built["zero_optimization"]["offload_optimizer"]["ratio"] == 0.25
    # the config's own settings win over the JSON's; without a JSON DeepSpeed builds stage 2 and no offload
    own = parse_args(["--config", str(REPO / "recipes" / "code_lm_tiny.yaml"), "--backend.deepspeed_config", str(path),
                      "--backend.offload_optimizer_ratio", "0.5"])
    assert resolve_engine(own.backend, 2, 0).offload_optimizer_ratio == 0.5
    bare = parse_args(["--config", str(REPO / "recipes" / "code_lm_tiny.yaml"), "--backend.name", "deepspeed"])
    bare_spec = resolve_engine(bare.backend, 2, 0)
    assert (bare_spec.zero_stage, bare_spec.offload, dict(bare_spec.deepspeed_json)) == (2, "none", {})
    ddp = resolve_engine(parse_args(["--config", str(REPO / "recipes" / "code_lm_tiny.yaml")]).backend, 2, 0)
    assert (ddp.name, ddp.zero_stage, ddp.offload) == ("ddp", None, "none")

def test_zero2_reduces_in_place_unless_the_json_says_otherwise():
    """Under ZeRO-2 memtrain turns DeepSpeed's ``reduce_scatter`` off where the JSON leaves it unset
    (or ``auto``), so the bucket is all-reduced in place instead of through a flattened copy; a
    JSON's own value is kept, ZeRO-3 keeps DeepSpeed's default, and what the run reports (the
    accounting's input) is what the config holds."""
    from memtrain.backends.deepspeed import size_buffers
    from memtrain.memory.shape import ModelShape

    shape = ModelShape(1000, largest_block=100, largest_module=50)
    for stage, json_value, written in ((2, None, False), (2, "auto", False), (2, True, True), (2, False, False),
                                       (3, None, None), (1, None, None)):
        zero = {"stage": stage, **({} if json_value is None else {"reduce_scatter": json_value})}
        cfg = {"zero_optimization": zero}
        settings = size_buffers(cfg, shape, 1000)
        assert cfg["zero_optimization"].get("reduce_scatter") is written, (stage, json_value)
        assert settings["reduce_scatter"] == int(written if written is not None else True)
        assert settings["reduce_bucket_size"] == 1000


def test_auto_values_are_filled_from_memtrain():
    with open("ds_configs/zero3_offload.json") as fh:
        user = json.load(fh)
    cfg = build_ds_config(user, "zero3_offload.json", **PLAN)
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (16, 2, 4)
    assert cfg["gradient_clipping"] == 1.0 and cfg["bf16"]["enabled"] is False and cfg["fp16"]["enabled"] is False
    assert cfg["zero_optimization"]["stage"] == 3
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


@pytest.mark.parametrize("key,value,field", [
    ("train_micro_batch_size_per_gpu", 4, "training.micro_batch_size"),
    ("train_batch_size", 64, "training.global_batch_size"),
    ("gradient_clipping", 0.5, "training.max_grad_norm"),
])
def test_contradicting_value_names_both(key, value, field):
    with pytest.raises(ConfigError) as err:
        build_ds_config({key: value}, "mine.json", **PLAN)
    msg = str(err.value)
    assert f"'{field}'" in msg and f"mine.json sets {key} = {value}" in msg


def test_contradicting_stage_and_precision():
    with pytest.raises(ConfigError, match="backend.zero_stage"):
        build_ds_config({"zero_optimization": {"stage": 3}}, "mine.json", **{**PLAN, "zero_stage": 2})
    with pytest.raises(ConfigError, match="'precision'.*bf16.enabled"):
        build_ds_config({"bf16": {"enabled": True}}, "mine.json", **PLAN)
    # precision auto defers to an explicit choice in the JSON
    cfg = build_ds_config({"bf16": {"enabled": True}}, "mine.json", **{**PLAN, "precision_requested": "auto"})
    assert cfg["bf16"]["enabled"] is True and cfg["fp16"]["enabled"] is False


HF_STYLE = "ds_configs/zero2_offload_hf.json"  # as in the transformers DeepSpeed docs: optimizer + scheduler "auto"


def test_optimizer_and_scheduler_sections_are_filled_from_training():
    from memtrain.config import TrainingConfig

    with open(HF_STYLE) as fh:
        user = json.load(fh)
    t = TrainingConfig(lr=3e-4, adam_beta1=0.8, adam_beta2=0.99, adam_eps=1e-6, weight_decay=0.01, warmup_steps=5,
                       max_steps=40)
    cfg = build_ds_config(user, HF_STYLE, **PLAN, training=t)
    assert cfg["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.8, 0.99], "eps": 1e-6,
                                                            "weight_decay": 0.01}}
    assert cfg["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4, "warmup_num_steps": 5,
                                          "total_num_steps": 40}
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


@pytest.mark.parametrize("section,value,field", [
    ({"optimizer": {"type": "AdamW", "params": {"lr": 5e-5}}}, "optimizer.params.lr = 5e-05", "training.lr"),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 0.999]}}}, "optimizer.params.betas",
     "training.adam_beta1/adam_beta2"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 1000}}},
     "scheduler.params.total_num_steps = 1000", "training.max_steps"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 7}}}, "scheduler.params.warmup_num_steps = 7",
     "training.warmup_steps"),
])
def test_contradicting_optimizer_or_scheduler_value_names_both(section, value, field):
    with pytest.raises(ConfigError) as err:
        build_ds_config(section, "mine.json", **PLAN)
    assert f"'{field}'" in str(err.value) and f"mine.json sets {value}" in str(err.value)


@pytest.mark.parametrize("section,choices", [
    ({"optimizer": {"type": "Lamb"}}, "Adam, AdamW"),
    ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}, "adam_w_mode = True"),
    ({"scheduler": {"type": "OneCycle"}}, "WarmupLR, WarmupDecayLR, WarmupCosineLR"),
])
def test_optimizer_or_scheduler_memtrain_does_not_build_is_named(section, choices):
    with pytest.raises(ConfigError, match=choices):
        build_ds_config(section, "mine.json", **PLAN)


@pytest.mark.parametrize("kind,params", [
    ("WarmupDecayLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 4, "total_num_steps": 12}),
    ("WarmupCosineLR", {"warmup_min_ratio": 0.0, "cos_min_ratio": 0.1, "warmup_num_steps": 4, "total_num_steps": 12,
                        "warmup_type": "linear"}),
])
def test_deepspeed_schedule_follows_deepspeed_and_resumes_exactly(kind, params):
    """The schedule memtrain steps gives DeepSpeed's own rates, and one rebuilt from its state
    mid-way (a resume) continues with the very same rates from its first step."""
    import torch
    from deepspeed.runtime import lr_schedules

    from memtrain.optim import DeepSpeedSchedule

    def optimizer():
        return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-2)

    reference_opt = optimizer()
    reference = getattr(lr_schedules, kind)(reference_opt, **params)
    ours_opt = optimizer()
    ours = DeepSpeedSchedule(ours_opt, {"type": kind, "params": params})
    rates, expected = [], []
    for step in range(12):
        if step == 6:  # resume: a new optimizer and schedule, loaded from the state
            state = ours.state_dict()
            ours_opt = optimizer()
            ours = DeepSpeedSchedule(ours_opt, {"type": kind, "params": params})
            ours.load_state_dict(state)
        rates.append(ours_opt.param_groups[0]["lr"])
        expected.append(reference_opt.param_groups[0]["lr"])
        assert ours.get_last_lr() == [rates[-1]]
        ours.step()
        reference.step()
    assert rates == expected and len(set(rates)) > 4


def _launch_env(**values):
    return {k: str(v) for k, v in values.items()}


def _cfg(*args):
    from memtrain.config import parse_args

    return parse_args(["--training.global_batch_size", "32", *args])


def test_accelerate_accumulation_is_applied_or_contradicts():
    from memtrain.launcher import apply_accelerate_settings

    env = _launch_env(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_GRADIENT_ACCUMULATION_STEPS=4,
                      ACCELERATE_GRADIENT_CLIPPING=0.5, ACCELERATE_MIXED_PRECISION="bf16")
    cfg = _cfg()  # micro_batch_size, max_grad_norm and precision at their defaults: the launcher's win
    apply_accelerate_settings(cfg, 2, env)
    assert (cfg.training.micro_batch_size, cfg.training.max_grad_norm, cfg.precision) == (4, 0.5, "bf16")
    with pytest.raises(ConfigError) as err:
        apply_accelerate_settings(_cfg("--training.micro_batch_size", "16"), 2, env)
    assert "'training.micro_batch_size'" in str(err.value) and "gradient_accumulation_steps = 4" in str(err.value)
    for args, field in ((["--training.max_grad_norm", "2.0"], "training.max_grad_norm"),
                        (["--precision", "fp32"], "precision"), (["--backend.name", "ddp"], "backend.name")):
        with pytest.raises(ConfigError, match=f"'{field}'"):
            apply_accelerate_settings(_cfg(*args), 2, env)


def test_accelerate_settings_memtrain_does_otherwise_are_named():
    from memtrain.launcher import apply_accelerate_settings

    fsdp = _launch_env(ACCELERATE_USE_FSDP="true", FSDP_VERSION=1, FSDP_ACTIVATION_CHECKPOINTING="true",
                       FSDP_STATE_DICT_TYPE="FULL_STATE_DICT", FSDP_AUTO_WRAP_POLICY="TRANSFORMER_BASED_WRAP")
    cfg = _cfg()
    warnings = apply_accelerate_settings(cfg, 2, fsdp)
    assert cfg.memory.activation_checkpointing == "on"
    assert any("fsdp_version = 1" in w for w in warnings) and any("FULL_STATE_DICT" in w for w in warnings)
    assert apply_accelerate_settings(_cfg(), 2, {}) == []  # plain launch: nothing to say
    with pytest.raises(ConfigError, match="dynamo_backend = INDUCTOR"):
        apply_accelerate_settings(_cfg(), 2, {"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"})
    with pytest.raises(ConfigError, match="'memory.activation_checkpointing'"):
        apply_accelerate_settings(_cfg("--memory.activation_checkpointing", "off"), 2, fsdp)


def test_zero3_builds_a_pretrained_model_already_partitioned(tmp_path):
    """ZeRO-3 + model.pretrained: the model comes out of the build partitioned (each parameter
    holds only its shard), with the full parameter count still known; other engines build it whole."""
    import subprocess
    import sys

    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=16, vocab_size=64)).save_pretrained(tmp_path)
    script = f"""
import torch.distributed as dist
dist.init_process_group("gloo")
from memtrain.config import parse_args
from memtrain.backends import model_build_context
from memtrain.backends.spec import resolve_engine
from memtrain.models import build_model, count_parameters
for engine in (["--backend.name", "deepspeed", "--backend.zero_stage", "3"], ["--backend.name", "ddp"]):
    cfg = parse_args([*engine, "--model.pretrained", {str(tmp_path)!r}, "--model.config", "{{}}"])
    with model_build_context(cfg, resolve_engine(cfg.backend, 1, 0), "fp32", 1):
        model = build_model(cfg.model, 64)
    print(engine[1], sum(p.numel() for p in model.parameters()), count_parameters(model))
"""
    import os

    repo = REPO
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "PYTHONPATH": str(repo)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True,
                         env=env, cwd=repo).stdout
    n = sum(p.numel() for p in GPT2LMHeadModel.from_pretrained(tmp_path).parameters())
    assert f"deepspeed 0 {n}" in out and f"ddp {n} {n}" in out


def test_accelerate_engine_settings_fill_the_backend_section_whatever_its_name():
    from memtrain.launcher import apply_accelerate_settings

    ds = _launch_env(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_ZERO_STAGE=3,
                     ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE="cpu")
    for name in ("auto", "deepspeed"):
        cfg = _cfg("--backend.name", name)
        apply_accelerate_settings(cfg, 2, ds)
        assert (cfg.backend.zero_stage, cfg.backend.offload) == (3, "optimizer")
    with pytest.raises(ConfigError, match="'backend.zero_stage'.*zero_stage = 3"):
        apply_accelerate_settings(_cfg("--backend.zero_stage", "2"), 2, ds)
    cfg = _cfg()
    apply_accelerate_settings(cfg, 2, {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": HF_STYLE})
    assert cfg.backend.deepspeed_config == HF_STYLE
    with pytest.raises(ConfigError, match="'backend.deepspeed_config'"):
        apply_accelerate_settings(_cfg("--backend.deepspeed_config", "ds_configs/zero2.json"), 2,
                                  {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": HF_STYLE})
    fsdp = _launch_env(ACCELERATE_USE_FSDP="true", FSDP_RESHARD_AFTER_FORWARD="false", FSDP_OFFLOAD_PARAMS="true")
    cfg = _cfg("--backend.name", "fsdp")
    apply_accelerate_settings(cfg, 2, fsdp)
    assert (cfg.backend.reshard_after_forward, cfg.backend.offload) == (False, "optimizer_and_params")
    with pytest.raises(ConfigError, match="'backend.reshard_after_forward'"):
        apply_accelerate_settings(_cfg("--backend.reshard_after_forward", "false"), 2,
                                  {**fsdp, "FSDP_RESHARD_AFTER_FORWARD": "true"})
    with pytest.raises(ConfigError, match="gradient_accumulation_steps = 'two'"):
        apply_accelerate_settings(_cfg(), 2, {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "two"})


def test_an_accelerate_config_asking_for_several_cpu_processes_that_start_one_is_refused(tmp_path):
    """``distributed_type: MULTI_CPU`` with 2 processes and no mpirun: Accelerate's launcher starts
    one process. memtrain stops before anything is written (exit 2, which Accelerate's launcher
    reports as its own failure) and says how to launch instead."""
    import subprocess
    import sys

    from memtrain.launcher import apply_accelerate_settings

    config = tmp_path / "multi_cpu.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_machines: 1\n"
                      "num_processes: 2\nuse_cpu: true\nmixed_precision: 'no'\nmachine_rank: 0\n"
                      f"main_process_ip: 127.0.0.1\nmain_process_port: {_free_port()}\n")
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                           str(REPO / "memtrain" / "train.py"), "--config", str(REPO / "recipes" / "code_lm_tiny.yaml"),
                           "--output_dir", str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    # memtrain exits 2; Accelerate's simple launcher reports that and exits 1 itself
    assert proc.returncode != 0 and "returned non-zero exit status 2" in proc.stderr, proc.stderr[-3000:]
    assert "started this one alone" in proc.stderr and "--multi_gpu --num_processes N" in proc.stderr
    assert not out.exists()
    # the same environment under torchrun (WORLD_SIZE) or mpirun is a real world: nothing to say
    env = _launch_env(ACCELERATE_MIXED_PRECISION="no", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    for world in ({"WORLD_SIZE": "2"}, {"OMPI_COMM_WORLD_SIZE": "2"}):
        assert apply_accelerate_settings(_cfg(), 2, {**env, **world}) == []
