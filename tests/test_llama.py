"""Llama and Hugging Face checkpoints: logits equal the reference implementation's (transformers'
Flax models, which write the checkpoints) on one device and on tensor-parallel grids; checkpoints
round-trip; fine-tuning from a checkpoint, and llama-tiny in the trainer's modes, reproduce one
device's loss trajectory; mismatches are named."""
import json
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from transformers import (FlaxGPT2LMHeadModel, FlaxLlamaForCausalLM, GPT2Config, LlamaConfig)
from transformers.models.llama import modeling_flax_llama

from axonn_jax import ParallelConfig as P, make_mesh
from axonn_jax.models import gpt, llama
from axonn_jax.run.cli import main as cli_main
from axonn_jax.run.data import encode
from axonn_jax.train import TrainOptions, build_trainer, train

from conftest import (COMPRESSED, PARITY, assert_learns, assert_states_match, assert_steps_match,
                      comparable_state, field, lm_batches, relative_difference, run_steps,
                      state_tolerances)

TOKENS = np.random.default_rng(0).integers(0, 256, (4, 16)).astype(np.int32)
TEXT = " ".join(f"the {a} {b} runs over the {c}." for a in ("quick", "lazy", "red", "small")
                for b in ("fox", "dog", "cat") for c in ("hill", "wall", "road", "river")) * 8
LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=128, rms_norm_eps=1e-5)


def write_tokenizer(path):
    """A word-level `tokenizer.json` for TEXT (ids below the models' 256)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted(set(TEXT.replace(".", " .").split()))
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, "[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


def reference_dir(path, model):
    """Save a transformers Flax model as a Hugging Face directory; (path, logits on TOKENS)."""
    model.save_pretrained(path, safe_serialization=True)
    return path, np.asarray(model(TOKENS).logits)


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """Grouped-query attention (4 query heads, 2 key/value heads), with a tokenizer."""
    path, logits = reference_dir(tmp_path_factory.mktemp("llama"), FlaxLlamaForCausalLM(
        LlamaConfig(**LLAMA, num_key_value_heads=2), seed=0))
    write_tokenizer(path)
    return path, logits


@pytest.fixture(scope="module")
def hf_llama_mqa(tmp_path_factory):
    """Multi-query attention (one key/value head)."""
    return reference_dir(tmp_path_factory.mktemp("llama_mqa"), FlaxLlamaForCausalLM(
        LlamaConfig(**LLAMA, num_key_value_heads=1), seed=1))


@pytest.fixture(scope="module")
def hf_gpt2(tmp_path_factory):
    """GPT-2 (tied embeddings, fused query/key/value Conv1D kernels)."""
    return reference_dir(tmp_path_factory.mktemp("gpt2"), FlaxGPT2LMHeadModel(
        GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=64), seed=0))


def logits_of(module, params):
    return np.asarray(jax.jit(module.apply)({"params": params}, TOKENS))


@pytest.mark.parametrize("which, grid", [
    ("gqa", None), ("gqa", P(data=2, row=2, col=2)), ("gqa", P(depth=2, row=4)),
    ("mqa", P(depth=2, row=2, col=2))], ids=["1device", "data2-row2-col2", "depth2-row4",
                                            "mqa-depth2-row2-col2"])
def test_llama_logits_match_reference(which, grid, hf_llama, hf_llama_mqa, devices):
    path, want = hf_llama if which == "gqa" else hf_llama_mqa
    mesh = None if grid is None else make_mesh(grid, devices)
    module, params = llama.from_pretrained(path, mesh)
    assert relative_difference(logits_of(module, params), want) <= 1e-5
    if grid is None:
        return
    q, k = params["blocks"]["q_proj"]["kernel"], params["blocks"]["k_proj"]["kernel"]
    tp = grid.depth * grid.row * grid.col  # (layers, in, out) split in over col·depth, out over row
    assert {s.data.size for s in q.addressable_shards} == {q.size // tp}
    # Key/value heads split over row when they divide over it, else whole on every row device.
    kv_split = module.config.num_kv_heads % grid.row == 0
    assert module.replicate_kv != kv_split
    assert {s.data.size for s in k.addressable_shards} == {k.size // (tp if kv_split else tp // grid.row)}


def test_gpt2_logits_match_reference(hf_gpt2, devices):
    path, want = hf_gpt2
    for mesh in (None, make_mesh(P(depth=2, row=2, col=2), devices)):
        module, params = gpt.from_pretrained(path, mesh)
        assert module.config.tie_embeddings and "lm_head" not in params["head"]
        assert relative_difference(logits_of(module, params), want) <= 1e-5


def test_exports_load_in_the_reference_and_back(hf_llama, hf_gpt2, tmp_path):
    """from_pretrained -> to_pretrained -> the reference gives the same logits (the PyTorch
    layout, which transformers converts); a sharded export (with an index) reads back."""
    (l_path, l_want), (g_path, g_want) = hf_llama, hf_gpt2
    module, params = llama.from_pretrained(l_path)
    llama.to_pretrained(module, params, tmp_path / "llama")
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and config["bos_token_id"] == 1  # source fields kept
    back = FlaxLlamaForCausalLM.from_pretrained(tmp_path / "llama")
    assert relative_difference(np.asarray(back(TOKENS).logits), l_want) <= 1e-6

    module, params = gpt.from_pretrained(g_path)
    gpt.to_pretrained(module, params, tmp_path / "gpt2")
    back = FlaxGPT2LMHeadModel.from_pretrained(tmp_path / "gpt2")
    assert relative_difference(np.asarray(back(TOKENS).logits), g_want) <= 1e-6
    gpt.to_pretrained(module, params, tmp_path / "sharded", max_shard_bytes=16_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    module, params = gpt.from_pretrained(tmp_path / "sharded")
    assert relative_difference(logits_of(module, params), g_want) <= 1e-5


def _hf_rope_table(num_pos, dim, theta, scaling):
    """transformers' `_compute_default_rope_parameters` and `_compute_llama3_parameters`
    (modeling_rope_utils.py, 4.46), line by line in numpy, in the sin/cos table layout of
    modeling_flax_llama's `create_sinusoidal_positions`."""
    import math

    inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2).astype(np.float32) / dim))
    factor, low_freq_factor = scaling["factor"], scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    inv_freq_llama = np.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)
    freqs = np.einsum("i , j -> i j", np.arange(num_pos), inv_freq_llama).astype("float32")
    emb = np.concatenate((freqs, freqs), axis=-1)
    return np.concatenate((np.sin(emb)[:, None, :], np.cos(emb)[:, None, :]), axis=-1)


def test_rope_theta_and_llama3_scaling_match_reference(tmp_path, monkeypatch):
    """A Llama 3.1 style rotary embedding (theta 500000, frequency scaling with low, blended and
    high frequencies at head_dim 16): the reference's Flax model has no `rope_theta` or
    `rope_scaling`, so its sinusoid table is given transformers' own formulas."""
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)
    config = LlamaConfig(**LLAMA, num_key_value_heads=2, rope_theta=500000.0, rope_scaling=scaling)
    monkeypatch.setattr(modeling_flax_llama, "create_sinusoidal_positions",
                        lambda n, d: _hf_rope_table(n, d, 500000.0, scaling))
    path, want = reference_dir(tmp_path / "llama31", FlaxLlamaForCausalLM(config))
    module, params = llama.from_pretrained(path)
    assert module.config.rope_scaling == llama.RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    assert relative_difference(logits_of(module, params), want) <= 1e-5


def _edited(src, dst, config=None, drop=None):
    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, **config}))
    if drop:
        tensors = load_file(dst / "model.safetensors")
        del tensors[drop]
        save_file(tensors, dst / "model.safetensors", metadata={"format": "flax"})
    return dst


def test_mismatches_are_named(hf_llama, hf_gpt2, tmp_path, capsys):
    path = hf_llama[0]
    cases = [
        (hf_gpt2[0], "model_type = 'gpt2' is not supported"),
        (_edited(path, tmp_path / "yarn", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}),
         "rope_scaling of type 'yarn' is not supported"),
        (_edited(path, tmp_path / "drop", drop="model.layers.1.mlp.up_proj.kernel"),
         "missing tensor(s) model.layers.1.mlp.up_proj.kernel"),
        (_edited(path, tmp_path / "ff", {"intermediate_size": 96}),
         "model.layers.0.mlp.down_proj.kernel has shape (128, 64), the model needs (96, 64)"),
        (_edited(path, tmp_path / "layers", {"num_hidden_layers": 1}),
         "unexpected tensor(s) model.layers.1."),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError) as e:
            llama.from_pretrained(bad)
        assert message in str(e.value)
    assert cli_main(["train", "--init-from", str(tmp_path / "ff"), "--steps", "1"]) == 2
    assert "the model needs (96, 64)" in capsys.readouterr().err


# ----------------------------------------------------------------------------- training

STEPS = 3
TRAIN_TOKENS = encode(TEXT)


def trajectory(devices, **options):
    """STEPS train steps on byte-level batches of TEXT, warm-up off: {'history': per-step
    records, 'state': the final state (`comparable_state`), 'options'}."""
    trainer = build_trainer(TrainOptions(**{"batch_size": 8, "seq_len": 16, "steps": STEPS,
                                            "lr": 1e-2, **PARITY, **options}), devices)
    state, history = run_steps(trainer, trainer.init_state(), lm_batches(trainer, TRAIN_TOKENS),
                               STEPS)
    return {"history": history, "state": comparable_state(trainer, state),
            "options": trainer.options}


def assert_trains_like(got, ref, rtol=1e-5, state=None, norm_rtol=None):
    """The same loss and gradient norm at every step, the same final state leaf by leaf (default
    tolerances: those of `got`'s dtype)."""
    diff = assert_steps_match(got["history"], ref["history"], rtol, norm_rtol)
    state = state or state_tolerances(got["options"].precision.dtype)
    assert_states_match(got["state"], ref["state"], **state)
    return diff


@pytest.fixture(scope="module")
def one_device(hf_llama, devices):
    """Single-device trajectories: fine-tuning the Llama checkpoint (fp32; its gradient norms stay
    above clip_norm = 1: clipped), llama-tiny from scratch (bf16)."""
    out = {"float32": trajectory(devices[:1], init_from=str(hf_llama[0])),
           "bfloat16": trajectory(devices[:1], model="llama-tiny", dtype="bfloat16")}
    assert min(r["grad_norm"] for r in out["float32"]["history"]) > 1.0
    return out


def test_finetuning_starts_from_the_checkpoint(hf_llama, one_device):
    """The first loss is the checkpoint's: the reference's cross-entropy on the first batch."""
    from axonn_jax.run.data import lm_batch as make

    batch = make(TRAIN_TOKENS, 0, 0, 8, 16)
    logits = FlaxLlamaForCausalLM.from_pretrained(hf_llama[0])(batch["inputs"]).logits
    logp = jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1)
    want = -np.mean(np.take_along_axis(np.asarray(logp), batch["targets"][..., None], -1))
    assert relative_difference(one_device["float32"]["history"][0]["loss"], want) <= 1e-5


# The Llama checkpoint (llama-tiny's shape) fine-tuned in the trainer's modes; bf16 trains
# llama-tiny from the preset.
MODES = {
    "hybrid-offload-remat": dict(parallel=P(data=2, row=2, col=2), offload_optimizer=True,
                                 remat="offload"),
    "kv-replicated-depth": dict(parallel=P(depth=2, row=4)),
    "pipeline-tensor": dict(parallel=P(pipe=2, row=2, data=2), microbatches=2, schedule="1f1b"),
    "compressed-remat": dict(parallel=P(data=8), compress_bits=8, remat="full"),
    "bf16": dict(parallel=P(data=2, row=2, col=2), dtype="bfloat16", model="llama-tiny"),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_llama_modes_follow_one_device(mode, hf_llama, one_device, devices):
    options = MODES[mode]
    if "model" not in options:
        options = dict(options, init_from=str(hf_llama[0]))
    got = trajectory(devices, **options)
    ref = one_device[options.get("dtype", "float32")]
    assert_learns(ref["history"], 0.9)  # measured 0.78 (fine-tuning), 0.58 (bf16, from scratch)
    if mode == "compressed-remat":  # 8-bit gradients: close, not equal (measured 1.7e-3 in the
        # losses, 1.9e-2 in the gradient norms)
        assert 0 < assert_trains_like(got, ref, 5e-3, COMPRESSED, norm_rtol=5e-2)
    elif mode == "bf16":  # bf16 all-reduces round differently from one device's sums; after
        # two updates the gradient norm moves by about one bf16 ulp (jaxlib 0.12 fuses differently)
        assert_trains_like(got, ref, 2e-3, norm_rtol=1e-2)
    else:
        assert_trains_like(got, ref)


def test_tied_gpt2_finetunes_on_a_pipeline(hf_gpt2, devices):
    """Tied embeddings across pipeline stages (the table's gradient from the first and the last
    stage summed), tensor-parallel, follow one device."""
    ref = trajectory(devices[:1], init_from=str(hf_gpt2[0]))
    got = trajectory(devices, init_from=str(hf_gpt2[0]), parallel=P(pipe=2, row=2, data=2),
                     microbatches=2)
    assert_trains_like(got, ref)


@pytest.mark.parametrize("options", [dict(parallel=P(row=2)),
                                     dict(dtype="bfloat16", offload_optimizer=True)],
                         ids=["row2", "bf16-offload"])
def test_fine_tunes_with_the_tokenizer_and_exports(hf_llama, tmp_path, devices, options):
    """`train --init-from DIR --data TEXT --export-to OUT`: the text is tokenized with the
    directory's tokenizer.json (cached next to it); OUT loads in the reference with the tokenizer
    and gives the logits of the trained parameters (the fp32 masters; after training on
    row-split layers, or in bf16 with the optimizer offloaded)."""
    path = hf_llama[0]
    data = tmp_path / "corpus.txt"
    data.write_text(TEXT)
    grid = options.get("parallel", P())
    summary = train(TrainOptions(init_from=str(path), data_path=str(data), steps=2, batch_size=8,
                                 seq_len=16, eval_batches=1, eval_every=100,
                                 export_to=str(tmp_path / "out"),
                                 **options), devices=devices[:grid.num_devices])
    cached = list(tmp_path.glob("corpus.txt.tokens-*.npy"))
    assert len(cached) == 1 and np.load(cached[0]).max() < 60  # word ids, not bytes
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    module, _ = llama.from_pretrained(path)
    trained = field(comparable_state(summary["trainer"], summary["state"]), "params")
    want = logits_of(module, trained)
    assert relative_difference(want, hf_llama[1]) > 1e-3  # training changed the model
    logits = np.asarray(FlaxLlamaForCausalLM.from_pretrained(tmp_path / "out")(TOKENS).logits)
    assert relative_difference(logits, want) <= 1e-5
