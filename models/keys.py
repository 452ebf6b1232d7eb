"""What each flat-config key of `build_model` means, in one table: docs/config.md's key tables are generated from it
(`python -m study.docs`; tests/test_docs.py fails when a key the models read has no entry here, or when the docs
differ from it). Which model families read a key is not written here: it is read from their config dataclasses."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KeyDoc:
    type: str  # the values allowed, as a reader writes them
    default: str  # what a model gets when the key is not set (`preset`: the preset's value)
    meaning: str


MODEL_KEY_DOCS: dict[str, KeyDoc] = {
    "model": KeyDoc("`vit` | `gpt` | `encdec`", "required", "model family"),
    "preset": KeyDoc("str", "`vit_tiny` / `gpt_tiny` / `encdec_tiny`",
                 "start from a preset (models/presets.py); other keys override it"),
    "dim": KeyDoc("int", "preset", "residual width"),
    "depth": KeyDoc("int", "preset", "number of blocks"),
    "num_heads": KeyDoc("int", "preset", "attention heads per layer (must divide `dim`)"),
    "mlp_ratio": KeyDoc("float", "4.0", "MLP hidden width / `dim`"),
    "qkv_bias": KeyDoc("bool", "ViT and encdec true, GPT false", "bias on the q, k, v projections"),
    "drop_path": KeyDoc("float in [0, 1)", "0.0",
                 "stochastic depth rate of each residual branch: in every block (ViT, `drop_path_by_depth: "
                 "uniform`), or at the last block, rising linearly from 0 in the first (GPT; ViT with `linear`)"),
    "laplacian_schedule": KeyDoc("`uniform` | `ramp` | `explicit`", "`uniform`",
                                 "how many Laplacian heads each layer has"),
    "k": KeyDoc("int in 0..num_heads", "0", "Laplacian heads per layer (`uniform`)"),
    "start_layer": KeyDoc("int >= 0", "-", "first layer (0-based) with Laplacian heads (`ramp`)"),
    "increment": KeyDoc("int >= 1", "-", "heads added per layer (`ramp`)"),
    "max_count": KeyDoc("int in 0..num_heads", "-", "cap on heads per layer (`ramp`)"),
    "k_per_layer": KeyDoc("list of `depth` ints", "-", "heads per layer (`explicit`)"),
    "image_size": KeyDoc("int", "preset", "input side in pixels"),
    "patch_size": KeyDoc("int dividing `image_size`", "preset", "patch side in pixels"),
    "in_chans": KeyDoc("int", "preset", "input channels"),
    "num_classes": KeyDoc("int >= 2", "preset", "classes"),
    "pool": KeyDoc("`cls` | `mean`", "`cls`", "what the classifier reads: the class token or the token mean"),
    "layer_scale_init": KeyDoc("float >= 0", "1e-4",
                 "LayerScale initial value on both branches of every block (DeiT III's, every size; 0 turns "
                 "LayerScale off)"),
    "drop_path_by_depth": KeyDoc("`uniform` | `linear`", "`uniform`",
                 "stochastic depth per block: `drop_path` in every block (DeiT III, models_v2.py), or the linear 0"
                 " -> `drop_path` ramp of DeiT I and timm"),
    "class_pos_embed": KeyDoc("bool", "false",
                 "a learned position embedding for the class token as well as the patches, one `pos_embed` over 1 "
                 "+ P tokens as DINO and timm store it (so DINO's per-parameter gradient clipping sees it whole); "
                 "DeiT III has none"),
    "norm_eps": KeyDoc("float > 0", "1e-6", "eps of every LayerNorm (DeiT III's; the GPT keeps PyTorch's 1e-5)"),
    "vocab_size": KeyDoc("int", "preset",
                 "vocabulary size (encdec: the target's, and the source's unless `src_vocab_size`)"),
    "context_length": KeyDoc("int", "preset",
                 "longest sequence (GPT: its RoPE table length; encdec: only STLT's `stlt_T_init: auto` reads it)"),
    "tie_embeddings": KeyDoc("bool", "false", "share the token embedding and the output head"),
    "rope_base": KeyDoc("float", "10000", "RoPE base frequency"),
    "block_style": KeyDoc("`gpt2` | `nanochat`", "`gpt2` (`gpt_d20`: `nanochat`)",
                 "the blocks: GPT-2 style (LayerNorm, GELU, fused q/k/v), or karpathy/nanochat's GPT "
                 "(parameter-free RMS norms, QK norm, ReLU^2, logit softcap; [nanochat.md](nanochat.md))"),
    "num_kv_heads": KeyDoc("int dividing `num_heads`", "`num_heads`",
                 "key/value heads shared by groups of query heads (GQA); `nanochat` style only"),
    # the encoder-decoder's own keys (docs/encdec.md)
    "src_vocab_size": KeyDoc("int >= 2 | null", "null", "source vocabulary with `embeddings` `decoder` or `separate`"),
    "decoder_depth": KeyDoc("int >= 1 | null", "`depth`", "decoder layers"),
    "decoder_mixer": KeyDoc("like `mixer`", "`attention`",
                 "causal self-mixer of every decoder layer, or one per layer (list or comma-separated string)"),
    "laplacian_sites": KeyDoc("comma-separated subset of `encoder`, `decoder`, `cross`, or `none`",
                              "`encoder,decoder,cross`",
                 "where the Laplacian-head schedule applies (below)"),
    "norm_position": KeyDoc("`post` | `pre`", "`post`", "post-norm (the paper's) or pre-norm"),
    "dropout": KeyDoc("float in [0, 1)", "0.0",
                 "residual dropout on each sub-layer's output and on embeddings + positions (Transformer-base: "
                 "0.1)"),
    "embeddings": KeyDoc("`shared` | `decoder` | `separate`", "`shared`",
                 "`shared`: one table for source, target and output (three-way tying, one vocabulary); `decoder`: "
                 "target table = output layer, the source has its own; `separate`: three tables"),
    "positions": KeyDoc("`sinusoidal` | `none`", "`sinusoidal`",
                 "the paper's sinusoids, `PE[pos, 2i] = sin(pos / 10000^(2i/D))`, `PE[pos, 2i+1] = cos(...)`, "
                 "added to the embeddings of both stacks"),
    "activation": KeyDoc("`relu` | `gelu`", "`relu`", "FFN nonlinearity"),
    "pad_id": KeyDoc("int", "0",
                 "padding token: `forward`, `encode` and `decode` derive the padding masks from it unless given "
                 "masks"),
}

# `mixer`, which picks each layer's token mixer, and the keys of the STLT mixer (models/stlt/, docs/stlt.md).
MIXER_KEY_DOCS: dict[str, KeyDoc] = {
    "mixer": KeyDoc("`attention` | `stlt` | list of `depth` of them | the list as one comma-separated string",
                    "`attention`",
                 "token mixer of every layer, or one per layer (`\"stlt,attention,stlt,attention\"` is the list in "
                 "one scalar, so a search space can offer it as a categorical choice). STLT layers are bilateral "
                 "in the ViT and causal in the GPT; they have no heads, so the Laplacian-head schedule must give "
                 "them 0"),
    "stlt_nodes": KeyDoc("int in 1..1024", "32", "S, the number of complex nodes s_k = sigma_k + i omega_k per layer"),
    "stlt_delta": KeyDoc("float > 0", "1.0",
                 "step Delta between positions; omega is bounded by the Nyquist limit pi / Delta"),
    "stlt_T_init": KeyDoc("`auto` | float >= 4", "`auto`",
                 "initial window bandwidth T; `auto` = max(4, sequence length / 16) (ViT: patches + 1, GPT: "
                 "`context_length`)"),
    "stlt_lambda_omega": KeyDoc("float >= 0", "0.01", "weight of the frequency sparsity term sum_k abs(omega_k) m_k"),
    "stlt_lambda_sigma": KeyDoc("float >= 0", "0.1",
                 "weight of the decay smoothness term sum_k (sigma_k - sigma_{k-1})^2 m_k m_{k-1}"),
    "stlt_lambda_mask": KeyDoc("float >= 0", "0.05", "weight of the node usage term sum_k m_k"),
    "stlt_reg_start_step": KeyDoc("int >= 0", "8000",
                 "optimiser step from which the regulariser is added (the write-up's 8k: switched on from step 0, "
                 "the usage term closes every gate before mixing pays off)"),
    "stlt_tau_start": KeyDoc("float > 0", "1.0", "relaxed-Bernoulli temperature at the start of training"),
    "stlt_tau_end": KeyDoc("float > 0", "0.2", "temperature at the end of the anneal"),
    "stlt_tau_hold": KeyDoc("float in [0, 1]", "0.1",
                 "fraction of training held at `stlt_tau_start` (the write-up's first 10%)"),
    "stlt_tau_anneal": KeyDoc("float in [0, 1], hold + anneal <= 1", "0.5",
                 "fraction of training, after the hold, over which tau goes geometrically to `stlt_tau_end`"),
    "stlt_lr_scale": KeyDoc("float > 0", "0.1",
                 "learning-rate factor of sigma and omega (`model.param_groups(weight_decay, slow_lr_scale)`); "
                 "read by the training loop"),
    "stlt_backend": KeyDoc("`auto` | `torch` | `triton`", "`auto`",
                 "`stlt_mix` backend: `auto` = Triton kernels on CUDA with up to 64 nodes (more would spill "
                 "registers), the torch path otherwise (the algorithm measured fastest at the length, see "
                 "[stlt.md](stlt.md#cost)); `triton` refuses more than 64 nodes"),
    "stlt_eval_gate": KeyDoc("`soft` | `hard`", "`soft`",
                             "the evaluation's node mask: `soft`, the write-up's inference rule (node k weighed by "
                             "alpha_k, skipped where alpha_k < 0.01); `hard`, 1[alpha > 0.5] "
                             "([stlt.md](stlt.md#node-gating))"),
}

# Keys renamed so that a search space's "schedule" words cannot be confused (the Laplacian heads per layer, the early
# stopping of trials, the learning rate's decay, stochastic depth over the blocks): old name -> (new name, what it
# is). The old name is refused with the new one, never translated, so a config read anywhere means one thing.
RENAMED_MODEL_KEYS: dict[str, tuple[str, str]] = {
    "schedule": ("laplacian_schedule", "the Laplacian heads per layer"),
    "drop_path_schedule": ("drop_path_by_depth", "the stochastic-depth rate over the blocks"),
}


def renamed_key_problem(key: str) -> str | None:
    """What is wrong with `key` when it is a renamed model key (one line naming the new key and its values); None
    for any other key."""
    if key not in RENAMED_MODEL_KEYS:
        return None
    new, what = RENAMED_MODEL_KEYS[key]
    return f"renamed {new} ({what}: {MODEL_KEY_DOCS[new].type.replace('`', '')})"
