"""Named starting points for `build_model`; any flat-config key overrides them."""

PRESETS: dict[str, dict] = {
    # CPU-sized models for tests, quickstarts and the offline data sets.
    "vit_tiny_digits": dict(model="vit", image_size=8, patch_size=2, in_chans=1, num_classes=10,
                            dim=64, depth=4, num_heads=4),
    "vit_tiny": dict(model="vit", image_size=32, patch_size=4, in_chans=3, num_classes=10,
                     dim=128, depth=6, num_heads=4),
    # DeiT sizes on ImageNet-1k (ViT-S is the DINO backbone of the paper).
    "vit_s16": dict(model="vit", image_size=224, patch_size=16, in_chans=3, num_classes=1000,
                    dim=384, depth=12, num_heads=6),
    "vit_b16": dict(model="vit", image_size=224, patch_size=16, in_chans=3, num_classes=1000,
                    dim=768, depth=12, num_heads=12),
    # ViT-B width and depth for 32x32 CIFAR images with 4x4 patches (the paper's CIFAR setting).
    "vit_b4_32": dict(model="vit", image_size=32, patch_size=4, in_chans=3, num_classes=100,
                      dim=768, depth=12, num_heads=12),
    "gpt_tiny": dict(model="gpt", vocab_size=257, context_length=128, dim=64, depth=4, num_heads=4),
    "gpt_small": dict(model="gpt", vocab_size=50304, context_length=1024, dim=768, depth=12, num_heads=12),
    # The paper's language model: nanochat's d20 (docs/nanochat.md). nanochat derives it from depth 20: width
    # 64 * depth = 1280, heads of dimension 128 (ceil(1280 / 128) = 10), as many key/value heads, 2**16 tokens,
    # sequence 2048, untied: 560,988,160 parameters.
    "gpt_d20": dict(model="gpt", block_style="nanochat", vocab_size=65536, context_length=2048, dim=1280, depth=20,
                    num_heads=10, num_kv_heads=10, tie_embeddings=False),
    # The same sizes in the GPT-2 style blocks (LayerNorm with weights, GELU, fused q/k/v, GPT-2 init): 561,040,640.
    "gpt_d20_gpt2": dict(model="gpt", block_style="gpt2", vocab_size=65536, context_length=2048, dim=1280, depth=20,
                         num_heads=10, tie_embeddings=False),
    # Encoder-decoders (models/encdec.py, docs/encdec.md). Transformer-base (Vaswani et al. 2017): 6 + 6 post-norm
    # layers, width 512, FFN 2048, 8 heads, dropout 0.1, one 37,000-token BPE vocabulary shared by source, target and
    # output (three-way tying): 63,082,496 parameters (tests/test_encdec.py writes out the sum).
    "encdec_tiny": dict(model="encdec", vocab_size=32, context_length=64, dim=64, depth=2, num_heads=4),
    "transformer_base": dict(model="encdec", vocab_size=37000, context_length=256, dim=512, depth=6, decoder_depth=6,
                             num_heads=8, mlp_ratio=4.0, dropout=0.1, embeddings="shared", norm_position="post"),
    # The same with STLT token mixing: bilateral in the encoder, causal in the decoder; cross-attention stays, and
    # is where the Laplacian-head schedule applies (STLT layers have no heads).
    "transformer_base_stlt": dict(model="encdec", vocab_size=37000, context_length=256, dim=512, depth=6,
                                  decoder_depth=6, num_heads=8, mlp_ratio=4.0, dropout=0.1, embeddings="shared",
                                  norm_position="post", mixer="stlt", decoder_mixer="stlt", laplacian_sites="cross"),
}

DEFAULT_PRESET = {"vit": "vit_tiny", "gpt": "gpt_tiny", "encdec": "encdec_tiny"}
