"""Configuration: presets, parameter counts, validation errors that name the field."""

import dataclasses
import typing

import jax
import pytest

import configs
from configs.base import Config
from errors import ConfigError
from gpt2 import GPT2Config, ShardingRules
from trainer.program.mesh import make_mesh
from gpt2.sharded_init import abstract_model


@pytest.mark.parametrize(
    "preset, expected",
    [("gpt2", 124_439_808), ("gpt2-medium", 354_823_168), ("gpt2-large", 774_030_080),
     ("gpt2-xl", 1_557_611_200)],
)
def test_preset_parameter_counts_equal_gpt2(preset, expected):
    config = GPT2Config.preset(preset)
    assert config.num_params() == expected
    # count the real (abstract) parameters too, not only the formula
    leaves = jax.tree.leaves(abstract_model(config, "dp"))
    assert sum(x.size for x in leaves) == expected


def test_vocab_padding_rounds_up_and_counts():
    c = GPT2Config.gpt2(pad_vocab_to=128)
    assert c.padded_vocab_size == 50304
    assert c.num_params() == 124_439_808 + (50304 - 50257) * 768


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n_head=5), "n_head"),  # does not divide 768
        (dict(n_layer=0), "n_layer"),
        (dict(n_embd=-8), "n_embd"),
        (dict(block_size=0), "block_size"),
        (dict(dropout=1.5), "dropout"),
        (dict(dtype="float8"), "dtype"),
        (dict(remat="sometimes"), "remat"),
    ],
)
def test_bad_model_values_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=f"model.{field}"):
        GPT2Config.gpt2(**kwargs)


def test_a_compute_dtype_the_backend_cannot_run_is_refused_naming_the_ones_it_can():
    from gpt2.config import check_compute_dtype

    with pytest.raises(ConfigError, match=r"model.dtype=float16 is not supported on cpu; use one of \['float32',"
                                          r" 'bfloat16'\]"):
        check_compute_dtype(GPT2Config(dtype="float16"), "cpu")
    check_compute_dtype(GPT2Config(dtype="bfloat16"), "cpu")
    check_compute_dtype(GPT2Config(dtype="float16"), "gpu")


def test_unknown_presets_list_the_choices():
    with pytest.raises(ConfigError, match="gpt2-xl"):
        GPT2Config.preset("gpt3")
    with pytest.raises(ConfigError, match="fsdp_tp"):
        ShardingRules.preset("zero3")
    with pytest.raises(ConfigError, match="shakespeare_cpu"):
        configs.load("nope")


def test_mesh_must_match_device_count():
    assert jax.device_count() == 8
    with pytest.raises(ConfigError, match="3×2×1 = 6 but there are 8 devices"):
        make_mesh(3, 2, 1)
    with pytest.raises(ConfigError, match="not divisible"):
        make_mesh(-1, 3, 1)
    assert dict(make_mesh(-1, 2, 2).shape) == {"data": 2, "fsdp": 2, "tensor": 2}


def test_rules_table_is_validated():
    with pytest.raises(ConfigError, match="unknown mesh axis 'model'"):
        ShardingRules.from_dict("bad", {"heads": "model"})
    with pytest.raises(ConfigError, match="unknown logical axis 'hidden'"):
        ShardingRules.from_dict("bad", {"hidden": "tensor"})
    rules = ShardingRules.from_dict("clash", {"embed": "fsdp", "mlp": "fsdp"})
    with pytest.raises(ConfigError, match="'embed' and 'mlp' .* both map to mesh axis 'fsdp'"):
        rules.spec(("embed", "mlp"))


@pytest.mark.parametrize("name", configs.PRESETS)
def test_every_config_file_loads(name):
    cfg = configs.load(name)
    assert isinstance(cfg, Config)
    assert cfg.train.seq_len <= cfg.model.block_size
    ShardingRules.preset(cfg.mesh.rules)


@pytest.mark.parametrize(
    "train, message",
    [
        (dict(seq_len=2048), "train.seq_len=2048 exceeds model.block_size"),
        (dict(batch_size=0), "train.batch_size must be an integer >= 1"),
        (dict(batch_size=10, grad_accum=4), "train.grad_accum=4 must divide"),
    ],
)
def test_cross_field_checks(train, message):
    base = configs.load("shakespeare_cpu")
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(base, train=dataclasses.replace(base.train, **train))


def test_flops_per_token_matches_the_standard_formula():
    c = GPT2Config.gpt2()
    n = 124_439_808 - 1024 * 768  # non-embedding params + the tied head (wte) used as a matmul
    assert c.flops_per_token(1024) == 6 * n + 12 * 12 * 768 * 1024


def _numeric_fields():
    """(section, field) of every int or float field of the training config's sections (optional ones too)."""
    base = configs.load("shakespeare_cpu")
    for f in dataclasses.fields(base):
        section = getattr(base, f.name)
        if not dataclasses.is_dataclass(section):
            continue
        for name, hint in typing.get_type_hints(type(section)).items():
            if {int, float} & ({hint} | set(typing.get_args(hint))) and bool not in typing.get_args(hint):
                yield f.name, name


def test_every_numeric_field_is_checked():
    sections = {section for section, _ in _numeric_fields()}
    assert len(list(_numeric_fields())) > 50 and sections >= {"model", "optim", "train", "mesh", "guard", "storage"}


@pytest.mark.parametrize("section, name", list(_numeric_fields()))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -10**9])
def test_every_numeric_field_rejects_nan_inf_and_out_of_range_values(section, name, bad):
    base = configs.load("shakespeare_cpu")
    with pytest.raises(ConfigError, match=f"^--{section}.{name} must be"):
        changed = dataclasses.replace(getattr(base, section), **{name: bad})
        dataclasses.replace(base, **{section: changed})


def test_multi_host_start_up_uses_jaxs_cluster_detection(monkeypatch):
    """No flags and no JAX_* variables: a SLURM (or TPU, Open MPI, Kubernetes) job is found by JAX's own
    detection; a plain machine is one process."""
    from configs.base import DistributedConfig
    from trainer.processes import job_settings

    for variable in ("SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri", "KUBERNETES_SERVICE_HOST", "JAX_COORDINATOR_ADDRESS"):
        monkeypatch.delenv(variable, raising=False)
    assert job_settings(DistributedConfig()) == (None, None, None)
    slurm = {"SLURM_JOB_ID": "42", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
             "SLURM_LOCALID": "0"}  # what srun sets for each task
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    assert job_settings(DistributedConfig()) == ("node1:61482", 2, 1)  # JAX's port: 61440 + 42 % 4096


def test_a_tpu_vms_metadata_server_late_to_answer_is_waited_for_and_one_never_answering_is_one_line(monkeypatch):
    """JAX's own TPU VM detection (a GCE TPU VM asks its metadata server which worker it is) against a server that
    starts listening 1.5 s late: the job is found; against none: one line naming the cause, after the retries."""
    import threading

    from jax._src.clusters import cloud_tpu_cluster

    import trainer.processes
    from configs.base import DistributedConfig
    from errors import UserError
    from support.cloud import _free_port, serve_metadata
    from trainer.processes import job_settings

    for variable in ("SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri", "KUBERNETES_SERVICE_HOST", "JAX_COORDINATOR_ADDRESS",
                     "TPU_SKIP_MDS_QUERY", "TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(cloud_tpu_cluster, "running_in_cloud_tpu_vm", True)
    monkeypatch.setenv("JAX_COORDINATOR_PORT", "8476")
    port = _free_port()
    monkeypatch.setenv("GCE_METADATA_IP", f"127.0.0.1:{port}")
    answers = {"agent-worker-number": "1", "tpu-env": "", "worker-network-endpoints": "10.0.0.2,10.0.0.3"}
    threading.Timer(1.5, serve_metadata, (port, answers)).start()
    assert job_settings(DistributedConfig()) == ("10.0.0.2:8476", 2, 1)

    monkeypatch.setenv("GCE_METADATA_IP", f"127.0.0.1:{_free_port()}")  # nothing listens there
    monkeypatch.setattr(trainer.processes, "DETECTION_RETRY_S", 2.0)
    with pytest.raises(UserError, match=r"^this host could not tell which job it belongs to: JAX's cluster detection"
                                        r" could not connect for 1 s \(.*Connection refused.*; on a Cloud TPU VM: its"
                                        r" metadata server\): run the command again") as e:
        job_settings(DistributedConfig())
    assert "\n" not in str(e.value)


def test_an_error_reason_keeps_the_cause_and_drops_tensorstores_spec():
    """TensorStore puts a kilobyte of JSON (`[tensorstore_spec='...']`) between the reason and its error code;
    the one-line reason keeps the cause at any path length."""
    from errors import first_line

    path = "/tmp/" + "run/" * 40 + "d/f03"
    spec = "{" + ",".join(f'\\"k{i}\\":{i}' for i in range(200)) + "}"
    e = OSError(f'OUT_OF_RANGE: Error writing "{path}": Failed to write 8921088 bytes to file 17: File too large'
                f" [tensorstore_spec='{spec}'] [os_error_code='27']")
    line = first_line(e)
    assert line.endswith("File too large [os_error_code='27']") and line.startswith("OUT_OF_RANGE: Error writing")
    assert len(line) <= 310 and "tensorstore_spec" not in line
