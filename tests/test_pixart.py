"""PixArt (adaln=single, the PixArt-* presets; dittrain/model/dit.py, dittrain/model/pixart.py): tiny random
diffusers PixArtTransformer2DModels saved with save_pretrained and read through the real --init-from path
(dittrain.inference.weights.init_model) give diffusers' outputs on the same inputs (square and other grids, padded
captions, with and without the 1024 micro-conditions); a run fine-tunes from one, resumes bit for bit after
SIGKILL and samples with --prompt; `dittrain export --format diffusers` writes a PixArtAlphaPipeline folder that
diffusers loads, whose transformer gives our outputs and whose pipeline runs 2 steps from the store's caption
embeddings (the store's text encoder is a tiny open_clip, not a T5: the folder has no text encoder).

Bounds: the square grid's outputs equal diffusers' to 1e-5 (measured 0: the same float32 operations); another
grid to 1e-5 relative to the outputs (diffusers computes the sin-cos table in float32, ours in float64: ~3e-8 on
the table).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from cliutil import dittrain, one_error_line, resume_after_sigkill, run_args
from storeutil import tiny_store
from test_sample import read_png
from tiny import save_tiny_kl

from ditdata.store import encode_array
from dittrain.inference.weights import WeightsError, init_model
from dittrain.model.dit import DiT, describe
from dittrain.model.sizes import CONFIGS, custom_name, flops_per_forward, get_config

pytestmark = pytest.mark.usefixtures("one_thread")
HEADS, HEAD_DIM, LAYERS, CAPTION = 2, 12, 2, 24  # hidden 24 (micro-conditions need a multiple of 3)
SPEC = custom_name(HEADS * HEAD_DIM, LAYERS, HEADS, 2, adaln="single", pos_interpolation=1.0)
MICRO_SPEC = custom_name(HEADS * HEAD_DIM, LAYERS, HEADS, 2, adaln="single", pos_interpolation=2.0,
                         micro_conditions=8)


def save_tiny_pixart(path: Path, *, micro: bool = False, caption: int = CAPTION, in_channels: int = 4,
                     seed: int = 0) -> Path:
    """A random PixArtTransformer2DModel (2 layers, 2 heads of 12, 8x8 latents), every weight drawn so that no
    table or projection is zero, saved with save_pretrained."""
    from diffusers import PixArtTransformer2DModel

    torch.manual_seed(seed)
    model = PixArtTransformer2DModel(
        num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=in_channels, out_channels=2 * in_channels,
        num_layers=LAYERS, sample_size=8, patch_size=2, cross_attention_dim=HEADS * HEAD_DIM, caption_channels=caption,
        use_additional_conditions=micro, interpolation_scale=2 if micro else 1)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def _inputs(n: int, h: int, w: int, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(n, 6, dtype=torch.bool)
    mask[1, 2:] = False  # padded captions: 2 and 1 real tokens
    mask[2, 1:] = False
    return {"x": torch.randn(n, 4, h, w, generator=g), "t": torch.tensor([0.0, 437.0, 999.0])[:n],
            "text_tokens": torch.randn(n, 6, CAPTION, generator=g), "text_mask": mask}


def _diffusers_out(ref, inp: dict, micro: bool) -> torch.Tensor:
    x = inp["x"]
    added = None
    if micro:  # what PixArtAlphaPipeline passes: the image's pixels (latent x 8) and height / width
        H, W = (s * 8 for s in x.shape[-2:])
        added = {"resolution": torch.tensor([[float(H), float(W)]]).repeat(x.shape[0], 1),
                 "aspect_ratio": torch.tensor([[H / W]]).repeat(x.shape[0], 1)}
    with torch.no_grad():
        return ref(x, encoder_hidden_states=inp["text_tokens"], timestep=inp["t"],
                   encoder_attention_mask=inp["text_mask"].float(), added_cond_kwargs=added).sample


@pytest.mark.parametrize("micro", [False, True], ids=["512", "1024-micro"])
def test_init_from_a_diffusers_folder_gives_diffusers_outputs(tmp_path, micro):
    from diffusers import PixArtTransformer2DModel

    folder = save_tiny_pixart(tmp_path / "pixart", micro=micro)
    ref = PixArtTransformer2DModel.from_pretrained(str(folder)).eval()
    dit = DiT(get_config(MICRO_SPEC if micro else SPEC, input_size=8, in_channels=4, num_classes=0,
                         text_token_dim=CAPTION, text_pooled_dim=16))  # a pooled embedding is not PixArt's: unused
    record, notes = init_model(dit, folder)
    assert record["kind"] == "diffusers-pixart" and record["model"] == (MICRO_SPEC if micro else SPEC) and not notes
    assert not hasattr(dit, "text_pooled_embedder")
    dit.eval()
    for h, w, bound in ((8, 8, 1e-5), (8, 12, None), (12, 6, None)):
        inp = _inputs(3, h, w)
        want = _diffusers_out(ref, inp, micro)
        with torch.no_grad():
            got = dit(**inp, text_pooled=torch.randn(3, 16))
        assert got.shape == want.shape == (3, 8, h, w)
        assert float(want.abs().max()) > 1.0  # outputs that depend on the weights
        assert float((got - want).abs().max()) <= (bound or 1e-5 * float(want.abs().max())), (h, w)
    # the padding is masked: a padded token's value changes nothing
    inp = _inputs(3, 8, 8)
    changed = dict(inp, text_tokens=inp["text_tokens"].clone())
    changed["text_tokens"][1, 4] += 5.0
    with torch.no_grad():
        assert torch.equal(dit(**inp), dit(**changed))
    # a batch as long as its longest caption (unpadded stores): the same captions padded further give the same
    # outputs, and a caption alone at its own length gives its row of the batch
    longer = dict(inp, text_tokens=torch.cat([inp["text_tokens"], torch.zeros(3, 4, CAPTION)], dim=1),
                  text_mask=torch.cat([inp["text_mask"], torch.zeros(3, 4, dtype=torch.bool)], dim=1))
    alone = {"x": inp["x"][2:], "t": inp["t"][2:], "text_tokens": inp["text_tokens"][2:, :1],
             "text_mask": inp["text_mask"][2:, :1]}
    with torch.no_grad():
        batch = dit(**inp)
        torch.testing.assert_close(dit(**longer), batch, rtol=0, atol=1e-5)
        torch.testing.assert_close(dit(**alone), batch[2:], rtol=0, atol=1e-5)
    # a pipeline folder: its transformer/
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    folder.rename(pipe / "transformer")
    dit2 = DiT(dit.config)
    init_model(dit2, pipe)
    assert all(torch.equal(a, b) for a, b in zip(dit.state_dict().values(), dit2.state_dict().values(), strict=True))


def test_init_from_refusals_name_both_sides(tmp_path):
    folder = save_tiny_pixart(tmp_path / "pixart")
    kw = dict(input_size=8, in_channels=4, num_classes=0, text_token_dim=CAPTION)
    cases = [
        (get_config(SPEC, **{**kw, "text_token_dim": 32}), ["caption_channels is 24", "text token width is 32"]),
        (get_config(SPEC, **{**kw, "in_channels": 3}), ["in_channels is 4", "latent channels is 3"]),
        (get_config("DiT-T/2", **kw), ["is a diffusers PixArtTransformer2DModel", "not a PixArt", f"--model {SPEC}"]),
        (get_config(custom_name(24, 3, 2, 2, adaln="single", pos_interpolation=1.0), **kw),
         ["depth 2 vs 3", f"--model {SPEC}"]),
        (get_config(MICRO_SPEC, **kw), ["pos_interpolation 1 vs 2", "micro_conditions 0 vs 8"]),
        (get_config(SPEC, **{**kw, "learn_sigma": False}), ["out_channels is 8", "is 4"]),
    ]
    for cfg, needles in cases:
        with pytest.raises(WeightsError) as e:
            init_model(DiT(cfg), folder)
        line = str(e.value)
        assert "\n" not in line and all(n in line for n in needles), line
    # another sample size is a note, not a refusal
    _, notes = init_model(DiT(get_config(SPEC, **{**kw, "input_size": 12})), folder)
    assert "8x8 latents" in notes[0] and "12x12" in notes[0]


def test_preset_sizes_params_and_flops():
    """PixArt-XL/2: 28 blocks of 1152 with 16 heads; ~611 M parameters with T5-XXL tokens (the paper's 0.6 B);
    adaLN-single's one regression instead of 28."""
    assert {k: CONFIGS["PixArt-XL/2"][k] for k in ("depth", "hidden_size", "num_heads", "patch_size", "adaln")} == {
        "depth": 28, "hidden_size": 1152, "num_heads": 16, "patch_size": 2, "adaln": "single"}
    row = describe("PixArt-XL/2", input_size=64, in_channels=4, num_classes=0, learn_sigma=True, text_token_dim=4096)
    assert 600e6 < row["params"] < 620e6, row["params"]
    with torch.device("meta"):
        diffusers_like = DiT(get_config("PixArt-XL/2", input_size=64, num_classes=0, text_token_dim=4096))
    zero = get_config("DiT-XL/2", input_size=64, num_classes=0, text_token_dim=4096)
    single = get_config("PixArt-XL/2", input_size=64, num_classes=0, text_token_dim=4096)
    assert flops_per_forward(zero, text_tokens=120) - flops_per_forward(single, text_tokens=120) == (
        28 * 6 * 1152**2 + 2 * 1152**2 - 6 * 1152**2)
    assert diffusers_like.blocks[0].scale_shift_table.shape == (6, 1152)


def _clip_text_store(root: Path, kl: Path) -> tuple[Path, Path]:
    """A text store of 12 latents 4x8x8 (a tiny diffusers AutoencoderKL, /2) whose text encoder is a tiny
    open_clip (tokens 77 x 24: the width of the tiny PixArt's captions), its empty caption embedded by it."""
    from test_clip import tiny_clip_conditioning  # skips the test without open_clip

    from ditdata.autoencoders.kinds import load_autoencoder

    conditioning, weights = tiny_clip_conditioning(root, name="tiny-clip", text_width=CAPTION)
    store = tiny_store(root / "store", shape=(4, 8, 8), vae=load_autoencoder(str(kl)).info,
                       conditioning=conditioning, text={"pooled": 32, "tokens": (77, CAPTION)}, n=12)
    return store, weights


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    """A run fine-tuned from a tiny diffusers PixArt (4 steps, a checkpoint at 2), straight and SIGKILLed at
    step 2 then resumed; returns (root, store, the diffusers folder)."""
    root = tmp_path_factory.mktemp("pixart")
    kl = save_tiny_kl(root / "tiny-kl", scaling_factor=0.5)
    store, _ = _clip_text_store(root / "data", kl)
    folder = save_tiny_pixart(root / "pixart")
    common = ["--model", SPEC, "--init-from", folder, "--max-steps", 4, "--save-every", 2, "--batch-size", 4,
              "--objective", "ddpm", "--lr", "2e-5", "--weight-decay", "0.03"]
    resume_after_sigkill(store, root, common, steps=4, half=2)
    return root, store, folder


def test_finetune_from_diffusers_trains_resumes_exactly_and_samples(finetuned, tmp_path):
    from safetensors.torch import load_file

    root, store, folder = finetuned
    run = root / "straight"
    config = json.loads((run / "config.json").read_text())
    assert config["init"]["kind"] == "diffusers-pixart" and config["model"]["adaln"] == "single"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(np.isfinite(r["loss"]) for r in rows)
    # the model started from the folder's weights: its first steps move them by little (lr 2e-5)
    ours = load_file(str(run / "ema.safetensors"))
    theirs = load_file(str(folder / "diffusion_pytorch_model.safetensors"))
    start = theirs["transformer_blocks.0.ff.net.0.proj.weight"]
    assert float((ours["blocks.0.mlp.fc1.weight"] - start).abs().max()) < 0.05 * float(start.abs().max())
    r = dittrain("sample", "--ckpt", run, "--out", tmp_path / "s", "--prompt", "a red fox", "--prompt", "a cat",
                 "--n-per-class", 1, "--steps", 3, "--cfg", 4.5, "--device", "cpu", "--seed", 1)
    assert r.exit_code == 0, r.output
    pngs = sorted((tmp_path / "s" / "samples").rglob("*.png"))
    assert len(pngs) == 2 and all(read_png(p).shape == (16, 16, 3) for p in pngs)
    assert not np.array_equal(*(read_png(p) for p in pngs))  # the prompt reaches the cross-attention


def test_export_is_a_pixart_pipeline_diffusers_loads_and_runs(finetuned, tmp_path):
    from diffusers import PixArtAlphaPipeline, PixArtTransformer2DModel

    from ditdata.store import open_store
    from dittrain.inference.export import pixart_versus
    from dittrain.inference.open_run import load_model
    from dittrain.inference.weights import load_weights

    root, store, _ = finetuned
    out = tmp_path / "pipe"
    r = dittrain("export", "--ckpt", root / "straight", "--format", "diffusers", "--out", out)
    assert r.exit_code == 0, r.output
    assert "max abs diff" in r.output and "no text_encoder/ or tokenizer/" in r.output
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == "PixArtAlphaPipeline" and index["text_encoder"] == [None, None]
    assert {p.name for p in out.iterdir()} >= {"transformer", "vae", "scheduler", "model_index.json"}
    state, config = load_weights(root / "straight")
    dit = load_model(state, config, "cpu")
    transformer = PixArtTransformer2DModel.from_pretrained(str(out / "transformer"), local_files_only=True).eval()
    inp = _inputs(3, 8, 8)
    assert pixart_versus(transformer, dit, inp) <= 1e-5
    # the pipeline, offline, 2 DPM-Solver steps from the store's caption embeddings and its empty caption
    pipe = PixArtAlphaPipeline.from_pretrained(str(out), local_files_only=True)
    st = open_store(store)
    empty = st.empty_caption()
    tokens = torch.randn(2, 77, CAPTION, generator=torch.Generator().manual_seed(0))
    neg = torch.as_tensor(np.asarray(empty["text_tokens"], dtype=np.float32))[None].expand(2, -1, -1)
    neg_mask = torch.as_tensor(np.asarray(empty["text_mask"]))[None].expand(2, -1).long()
    images = pipe(negative_prompt=None, prompt_embeds=tokens, prompt_attention_mask=torch.ones(2, tokens.shape[1], dtype=torch.long),
                  negative_prompt_embeds=neg, negative_prompt_attention_mask=neg_mask, num_inference_steps=2,
                  guidance_scale=4.5, height=16, width=16, use_resolution_binning=False, output_type="np",
                  generator=torch.Generator().manual_seed(0)).images
    assert images.shape == (2, 16, 16, 3) and np.isfinite(images).all()


def test_export_refuses_a_flow_pixart_in_one_line(tmp_path):
    from dataclasses import asdict

    from dittrain.diffusion import DiffusionConfig
    from dittrain.rundir import export_weights

    dit = DiT(get_config(SPEC, input_size=8, in_channels=4, num_classes=0, text_token_dim=CAPTION, learn_sigma=False))
    config = {"train": {"model": SPEC, "objective": "flow"}, "model": asdict(dit.config),
              "diffusion": asdict(DiffusionConfig(objective="flow", learn_sigma=False))}
    (tmp_path / "run").mkdir()
    export_weights(tmp_path / "run" / "ema.safetensors", dit.state_dict(), config)
    line = one_error_line(dittrain("export", "--ckpt", tmp_path / "run", "--format", "diffusers",
                                   "--out", tmp_path / "p").output)
    assert "objective is flow" in line and "PixArtAlphaPipeline" in line and not (tmp_path / "p").exists()


@pytest.mark.parametrize("mode", ["every", "selective", "attn"])
def test_grad_checkpointing_and_autocast(mode):
    """Checkpointed PixArt blocks give the plain forward's loss and gradients; under autocast the modulated
    activations stay in the autocast dtype (the table added in t0's dtype), as adaLN-Zero's do."""
    torch.manual_seed(0)
    cfg = get_config(SPEC, input_size=8, in_channels=4, num_classes=0, text_token_dim=CAPTION)
    plain = DiT(cfg)
    for p in plain.parameters():
        p.data.normal_(0, 0.1) if p.requires_grad else None
    ckpt = DiT(cfg)
    ckpt.load_state_dict(plain.state_dict())
    ckpt.set_grad_checkpointing(mode)
    inp = _inputs(3, 8, 8)
    losses = []
    for model in (plain, ckpt):
        model.train()
        loss = model(**inp).square().mean()
        loss.backward()
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1])
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        if a.requires_grad:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)
    # under autocast the MLP's input and the blocks' outputs have the dtypes adaLN-Zero's have
    zero = DiT(get_config(custom_name(24, LAYERS, HEADS, 2), input_size=8, in_channels=4, num_classes=0,
                          text_token_dim=CAPTION))
    seen = {}
    for model in (plain, zero):
        model.blocks[0].mlp.register_forward_hook(lambda m, i, o, model=model: seen.setdefault(id(model), []).append(
            i[0].dtype))
        model.blocks[0].register_forward_hook(lambda m, i, o, model=model: seen[id(model)].append(o.dtype))
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            model.eval()(**inp)
    assert seen[id(plain)] == seen[id(zero)], seen


def _save_tiny_t5(path: Path) -> Path:
    """A random 1-layer T5EncoderModel of width CAPTION and a word-level tokenizer, saved as a folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

    words = ["<pad>", "</s>", "<unk>", "a", "red", "fox", "cat"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(str(path))
    torch.manual_seed(0)
    T5EncoderModel(T5Config(vocab_size=len(words), d_model=CAPTION, d_kv=8, d_ff=32, num_layers=1,
                            num_heads=2)).save_pretrained(str(path))
    return path


def test_export_with_the_stores_t5_runs_the_pipeline_from_prompts(tmp_path):
    """A store whose text encoder is a local T5 folder (the manifest's text entry as ditdata.textencoders writes
    it): the export carries text_encoder/ and tokenizer/, and the pipeline samples from a prompt, offline."""
    from diffusers import PixArtAlphaPipeline
    from test_sample import make_run

    from ditdata.autoencoders.kinds import load_autoencoder

    t5 = _save_tiny_t5(tmp_path / "t5")
    kl = save_tiny_kl(tmp_path / "kl", scaling_factor=0.5)
    empty = {"text_pooled": np.zeros(16, np.float16), "text_tokens": np.zeros((6, CAPTION), np.float16),
             "text_mask": np.ones(6, bool)}
    text = {"encoder": str(t5), "kind": "transformers", "model_type": "t5", "path": str(t5), "pooled_dim": 16,
            "tokens_shape": [6, CAPTION], "empty": {k: encode_array(v) for k, v in empty.items()}}
    store = tiny_store(tmp_path / "store", shape=(4, 8, 8), vae=load_autoencoder(str(kl)).info,
                       conditioning={"type": "text", "text": text}, text={"pooled": 16, "tokens": (6, CAPTION)})
    run = make_run(tmp_path / "run", store, model=SPEC, text_token_dim=CAPTION)
    r = dittrain("export", "--ckpt", run, "--format", "diffusers", "--out", tmp_path / "pipe")
    assert r.exit_code == 0, r.output
    assert "no text_encoder/" not in r.output
    index = json.loads((tmp_path / "pipe" / "model_index.json").read_text())
    assert index["text_encoder"][1] == "T5EncoderModel" and index["tokenizer"][1] is not None
    pipe = PixArtAlphaPipeline.from_pretrained(str(tmp_path / "pipe"), local_files_only=True)
    images = pipe("a red fox", num_inference_steps=2, guidance_scale=4.5, height=16, width=16, clean_caption=False,
                  use_resolution_binning=False, output_type="np", generator=torch.Generator().manual_seed(0)).images
    assert images.shape == (1, 16, 16, 3) and np.isfinite(images).all()


def test_a_t5_store_finetunes_samples_and_exports_with_its_encoder(tmp_path):
    """The whole path on a store encoded with a T5 (ditdata encode --text-encoder DIR: unpadded tokens, PixArt's
    convention): --init-from a diffusers PixArt of the T5's width, a few steps, sample --prompt through the
    store's encoder, and the export carries that T5: diffusers' pipeline samples from a prompt, offline."""
    from diffusers import PixArtAlphaPipeline
    from test_score import caption_shards
    from textenc_util import save_text_encoder

    from ditdata.encode import EncodeConfig, encode

    t5 = save_text_encoder(tmp_path / "t5", "t5", width=CAPTION)
    kl = save_tiny_kl(tmp_path / "kl", scaling_factor=0.5)
    encode(EncodeConfig(shards=str(caption_shards(tmp_path / "shards")), out=str(tmp_path / "store"), vae=str(kl),
                        resolution=16, text_encoder=str(t5), workers=0, progress=False, device="cpu",
                        chunk_samples=2))
    folder = save_tiny_pixart(tmp_path / "pixart")
    r = dittrain(*run_args(tmp_path / "store", tmp_path / "run", "--init-from", folder, "--max-steps", 3,
                           "--batch-size", 4, "--objective", "ddpm", model=SPEC))
    assert r.exit_code == 0, r.output
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["init"]["kind"] == "diffusers-pixart" and config["model"]["text_token_dim"] == CAPTION
    r = dittrain("sample", "--ckpt", tmp_path / "run", "--out", tmp_path / "s.png", "--prompt", "a photo of the cat",
                 "--steps", 2, "--cfg", 4.5, "--device", "cpu")
    assert r.exit_code == 0, r.output
    r = dittrain("export", "--ckpt", tmp_path / "run", "--format", "diffusers", "--out", tmp_path / "pipe")
    assert r.exit_code == 0, r.output
    index = json.loads((tmp_path / "pipe" / "model_index.json").read_text())
    assert index["text_encoder"][1] == "T5EncoderModel" and index["tokenizer"][1] is not None
    pipe = PixArtAlphaPipeline.from_pretrained(str(tmp_path / "pipe"), local_files_only=True)
    images = pipe("a photo of the cat", num_inference_steps=2, guidance_scale=4.5, height=16, width=16,
                  clean_caption=False, use_resolution_binning=False, output_type="np",
                  generator=torch.Generator().manual_seed(0)).images
    assert images.shape == (1, 16, 16, 3) and np.isfinite(images).all()
