"""The two reference ViTs the paper's recipes train, written out as plain functions of a state dict in the
reference's own parameter names, for weight-transfer tests:

- DeiT III: facebookresearch/deit at 7e160fe, models_v2.py vit_models with Layer_scale_init_Block (deit_base_patch16_LS
  and deit_small_patch16_LS: LayerNorm eps 1e-6, qkv_bias, LayerScale on both branches, no position embedding on
  the class token). timm's deit3_* models are the same network (timm models/deit.py: VisionTransformer with
  no_embed_class=True, init_values), with gamma_1/gamma_2 named ls1.gamma/ls2.gamma.
- DINO: facebookresearch/dino at 7c446df, vision_transformer.py VisionTransformer (no LayerScale, one pos_embed over
  the class token and the patches, bicubically resized for other crop sizes) and DINOHead.

`project_to_*` renames this project's state dict into the reference's names: the weight transfer under test.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _layer_norm(x, w, prefix):  # models_v2.py:284, :325 and DINO's vit_small/base: LayerNorm(eps=1e-6)
    return F.layer_norm(x, x.shape[-1:], w[prefix + "weight"], w[prefix + "bias"], eps=1e-6)


def _attention(x, w, prefix, heads):
    """models_v2.py:26-40 and DINO vision_transformer.py:80-92 (q scaled by head_dim ** -0.5, softmax, proj)."""
    B, N, C = x.shape
    qkv = F.linear(x, w[prefix + "qkv.weight"], w[prefix + "qkv.bias"])
    q, k, v = qkv.reshape(B, N, 3, heads, C // heads).permute(2, 0, 3, 1, 4)
    attn = ((q * (C // heads) ** -0.5) @ k.transpose(-2, -1)).softmax(dim=-1)
    return F.linear((attn @ v).transpose(1, 2).reshape(B, N, C), w[prefix + "proj.weight"], w[prefix + "proj.bias"])


def _mlp(x, w, prefix):  # timm Mlp (models_v2 imports it) and DINO vision_transformer.py:49-65: fc1, GELU, fc2
    return F.linear(F.gelu(F.linear(x, w[prefix + "fc1.weight"], w[prefix + "fc1.bias"])),
                    w[prefix + "fc2.weight"], w[prefix + "fc2.bias"])


def _depth(w) -> int:
    return 1 + max(int(name.split(".")[1]) for name in w if name.startswith("blocks."))


def _patches(w, images, patch):  # timm PatchEmbed / DINO PatchEmbed: proj conv, flatten(2).transpose(1, 2)
    x = F.conv2d(images, w["patch_embed.proj.weight"], w["patch_embed.proj.bias"], stride=patch)
    return x.flatten(2).transpose(1, 2)


def deit3_forward(w: dict, images: torch.Tensor, heads: int, patch: int) -> torch.Tensor:
    """models_v2.py:243-262: patches + pos_embed, then the class token in front, the Layer_scale_init_Block
    blocks (:80-83), the final norm, the head on the class token. -> logits (B, num_classes)."""
    x = _patches(w, images, patch) + w["pos_embed"]
    x = torch.cat((w["cls_token"].expand(x.shape[0], -1, -1), x), dim=1)
    for i in range(_depth(w)):
        p = f"blocks.{i}."
        x = x + w[p + "gamma_1"] * _attention(_layer_norm(x, w, p + "norm1."), w, p + "attn.", heads)
        x = x + w[p + "gamma_2"] * _mlp(_layer_norm(x, w, p + "norm2."), w, p + "mlp.")
    x = _layer_norm(x, w, "norm.")[:, 0]
    return F.linear(x, w["head.weight"], w["head.bias"])


def dino_interpolate_pos_encoding(w: dict, npatch_h: int, npatch_w: int) -> torch.Tensor:
    """vision_transformer.py:174-194 for a crop of npatch_h x npatch_w patches -> (1, 1 + npatch_h * npatch_w, d)."""
    pos_embed = w["pos_embed"]
    N = pos_embed.shape[1] - 1
    if npatch_h * npatch_w == N and npatch_h == npatch_w:
        return pos_embed
    side, dim = int(math.sqrt(N)), pos_embed.shape[-1]
    h0, w0 = npatch_h + 0.1, npatch_w + 0.1
    patch_pos_embed = F.interpolate(pos_embed[:, 1:].reshape(1, side, side, dim).permute(0, 3, 1, 2),
                                    scale_factor=(h0 / math.sqrt(N), w0 / math.sqrt(N)), mode="bicubic")
    patch_pos_embed = patch_pos_embed.permute(0, 2, 3, 1).reshape(1, -1, dim)
    return torch.cat((pos_embed[:, :1], patch_pos_embed), dim=1)


def dino_forward(w: dict, images: torch.Tensor, heads: int, patch: int) -> torch.Tensor:
    """vision_transformer.py:196-215: class token in front, then the (resized) position embedding on every token,
    the blocks (:107-113, no LayerScale), the final norm; the class token. -> (B, d)."""
    x = _patches(w, images, patch)
    x = torch.cat((w["cls_token"].expand(x.shape[0], -1, -1), x), dim=1)
    x = x + dino_interpolate_pos_encoding(w, images.shape[-2] // patch, images.shape[-1] // patch)
    for i in range(_depth(w)):
        p = f"blocks.{i}."
        x = x + _attention(_layer_norm(x, w, p + "norm1."), w, p + "attn.", heads)
        x = x + _mlp(_layer_norm(x, w, p + "norm2."), w, p + "mlp.")
    return _layer_norm(x, w, "norm.")[:, 0]


def dino_head_forward(w: dict, x: torch.Tensor, layers: int = 3) -> torch.Tensor:
    """vision_transformer.py:257-291 (use_bn off): Linear-GELU pairs, the bottleneck Linear, L2 normalisation, the
    weight-normalised last layer g v / ||v|| (row norms) without bias."""
    for i in range(layers):
        x = F.linear(x, w[f"mlp.{2 * i}.weight"], w[f"mlp.{2 * i}.bias"])
        if i < layers - 1:
            x = F.gelu(x)
    x = F.normalize(x, dim=-1, p=2)
    v, g = w["last_layer.weight_v"], w["last_layer.weight_g"]
    return F.linear(x, g * v / v.norm(dim=1, keepdim=True))


def deit3_parameter_shapes(dim, depth, patch, in_chans, num_patches, num_classes) -> dict[str, tuple]:
    """vit_models' parameters (models_v2.py:192-214, :62-78; timm PatchEmbed and Mlp), mlp_ratio 4."""
    shapes = {"cls_token": (1, 1, dim), "pos_embed": (1, num_patches, dim),
              "patch_embed.proj.weight": (dim, in_chans, patch, patch), "patch_embed.proj.bias": (dim,)}
    for i in range(depth):
        shapes.update(_block_shapes(f"blocks.{i}.", dim))
        shapes.update({f"blocks.{i}.gamma_1": (dim,), f"blocks.{i}.gamma_2": (dim,)})
    return {**shapes, "norm.weight": (dim,), "norm.bias": (dim,), "head.weight": (num_classes, dim),
            "head.bias": (num_classes,)}


def dino_parameter_shapes(dim, depth, patch, in_chans, num_patches, out_dim, hidden=2048,
                          bottleneck=256) -> dict[str, tuple]:
    """MultiCropWrapper(VisionTransformer(num_classes=0), DINOHead) (utils.py:594-606, vision_transformer.py:134-163,
    :257-279): the backbone's head is nn.Identity, one pos_embed over 1 + P tokens, the head's weight_g and weight_v."""
    shapes = {"backbone.cls_token": (1, 1, dim), "backbone.pos_embed": (1, 1 + num_patches, dim),
              "backbone.patch_embed.proj.weight": (dim, in_chans, patch, patch),
              "backbone.patch_embed.proj.bias": (dim,)}
    for i in range(depth):
        shapes.update(_block_shapes(f"backbone.blocks.{i}.", dim))
    shapes.update({"backbone.norm.weight": (dim,), "backbone.norm.bias": (dim,),
                   "head.mlp.0.weight": (hidden, dim), "head.mlp.0.bias": (hidden,),
                   "head.mlp.2.weight": (hidden, hidden), "head.mlp.2.bias": (hidden,),
                   "head.mlp.4.weight": (bottleneck, hidden), "head.mlp.4.bias": (bottleneck,),
                   "head.last_layer.weight_g": (out_dim, 1), "head.last_layer.weight_v": (out_dim, bottleneck)})
    return shapes


def _block_shapes(prefix, dim) -> dict[str, tuple]:
    return {prefix + "norm1.weight": (dim,), prefix + "norm1.bias": (dim,),
            prefix + "attn.qkv.weight": (3 * dim, dim), prefix + "attn.qkv.bias": (3 * dim,),
            prefix + "attn.proj.weight": (dim, dim), prefix + "attn.proj.bias": (dim,),
            prefix + "norm2.weight": (dim,), prefix + "norm2.bias": (dim,),
            prefix + "mlp.fc1.weight": (4 * dim, dim), prefix + "mlp.fc1.bias": (4 * dim,),
            prefix + "mlp.fc2.weight": (dim, 4 * dim), prefix + "mlp.fc2.bias": (dim,)}


def _reference_name(name: str) -> str:
    """One parameter name of this project's ViT (or DINO student) in the references' naming."""
    name = name.replace("patch_embed.weight", "patch_embed.proj.weight").replace("patch_embed.bias",
                                                                                 "patch_embed.proj.bias")
    name = name.replace(".mixer.", ".attn.").replace(".ls1.gamma", ".gamma_1").replace(".ls2.gamma", ".gamma_2")
    return name.replace("last_layer.parametrizations.weight.original0", "last_layer.weight_g").replace(
        "last_layer.parametrizations.weight.original1", "last_layer.weight_v")


def project_to_reference(named) -> dict[str, torch.Tensor]:
    """This project's named parameters (a ViT's, or a DINO student's) under the reference's names."""
    return {_reference_name(name): value for name, value in named}
