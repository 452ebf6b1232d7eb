"""Probes on frozen features (models/probes.py): feature extraction from a real ViT, probes trained on features
separable by construction, mIoU against explicit per-class counts, confusion matrices that add up."""

import math

import pytest
import torch

from models.probes import (
    IGNORE_INDEX,
    LinearClassifier,
    LinearSegmentationHead,
    class_token_dim,
    class_token_features,
    confusion_matrix,
    iou_per_class,
    mean_iou,
    patch_token_dim,
    patch_token_features,
    pixel_accuracy,
    segmentation_loss,
)
from models.vit import ViT, ViTConfig


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Small matrices: one thread is faster than several on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _tiny_vit(**overrides) -> ViT:
    torch.manual_seed(0)
    config = dict(image_size=16, patch_size=4, dim=32, depth=5, num_heads=4, num_classes=5)
    return ViT(ViTConfig(**{**config, **overrides})).eval()


# ---- features -----------------------------------------------------------------------------------------------------

def test_class_token_features_of_a_vit_are_its_last_blocks_class_tokens():
    model = _tiny_vit()
    images = torch.randn(3, 3, 16, 16)
    with torch.no_grad(), model.layer_outputs() as outputs:
        out = model(images, return_features=True)
    assert len(outputs) == 5
    # the last block's class token is what the ViT's own classifier reads (pool="cls")
    torch.testing.assert_close(class_token_features(outputs, n_last_blocks=1), out.feature)
    features = class_token_features(outputs, n_last_blocks=4, avgpool_patchtokens=True)
    assert features.shape == (3, class_token_dim(32, 4, True)) == (3, 5 * 32)
    for k, block in enumerate(range(1, 5)):  # blocks 1..4 of 0..4, earliest first
        torch.testing.assert_close(features[:, 32 * k: 32 * (k + 1)], outputs[block][:, 0])
    torch.testing.assert_close(features[:, 128:], out.tokens[:, 1:].mean(dim=1))
    with pytest.raises(ValueError, match="n_last_blocks"):
        class_token_features(outputs, n_last_blocks=6)


def test_patch_token_features_put_each_patch_at_its_place_in_the_image():
    # LayerScale 0 makes every block the identity and zero position embeddings leave the patch embedding alone: the
    # token of image patch (i, j) is then norm(patch_embed(patch)), so only the map's (i, j) differs from the rest
    model = _tiny_vit(layer_scale_init=0.0)
    torch.nn.init.zeros_(model.pos_embed)
    for i, j in ((0, 0), (1, 3), (3, 2)):
        images = torch.zeros(1, 3, 16, 16)
        images[..., 4 * i: 4 * i + 4, 4 * j: 4 * j + 4] = torch.randn(3, 4, 4)
        with torch.no_grad(), model.layer_outputs() as outputs:
            model(images)
        maps = patch_token_features(outputs, grid=4)
        assert maps.shape == (1, 32, 4, 4)
        changed = (maps - maps[..., (i + 1) % 4, (j + 1) % 4, None, None]).abs().amax(dim=1)[0] > 1e-4
        assert changed.nonzero().tolist() == [[i, j]]


def test_patch_token_features_with_class_token_and_several_blocks():
    outputs = [torch.randn(2, 1 + 6, 8) for _ in range(3)]
    maps = patch_token_features(outputs, grid=(2, 3), n_last_blocks=2, cls_token=True)
    assert maps.shape == (2, patch_token_dim(8, 2, True), 2, 3) == (2, 32, 2, 3)
    for k, block in enumerate(outputs[1:]):
        base = 16 * k
        for p in range(6):  # token 1 + p is patch (p // 3, p % 3)
            torch.testing.assert_close(maps[:, base: base + 8, p // 3, p % 3], block[:, 1 + p])
            torch.testing.assert_close(maps[:, base + 8: base + 16, p // 3, p % 3], block[:, 0])
    with pytest.raises(ValueError, match="grid 2x2"):
        patch_token_features(outputs, grid=2)


# ---- heads trained on separable features --------------------------------------------------------------------------

def test_linear_classifier_init_is_eval_linears():
    torch.manual_seed(0)
    head = LinearClassifier(384 * 4, num_labels=1000)
    weight = head.linear.weight.detach()
    assert abs(float(weight.std()) - 0.01) < 0.0005 and abs(float(weight.mean())) < 0.0005
    assert torch.count_nonzero(head.linear.bias) == 0


def test_segmentation_head_init_and_batch_norm_are_dinov2s():
    torch.manual_seed(0)
    head = LinearSegmentationHead(384, 150)
    weight = head.conv_seg.weight.detach()
    assert weight.shape == (150, 384, 1, 1) and torch.count_nonzero(head.conv_seg.bias) == 0
    assert abs(float(weight.std()) - 0.01) < 0.0005
    # the batch norm standardises each channel over the batch and the grid: far-off features give the logits of
    # standardised ones; the bare linear map passes the offset and scale through
    features = 100.0 + 50.0 * torch.randn(8, 384, 4, 4)
    standardised = (features - features.mean(dim=(0, 2, 3), keepdim=True)) / features.std(dim=(0, 2, 3), unbiased=False,
                                                                                          keepdim=True)
    with torch.no_grad():
        torch.testing.assert_close(head.train()(features), head.conv_seg(standardised), atol=1e-4, rtol=1e-4)
        bare = LinearSegmentationHead(384, 150, batch_norm=False)
        bare.conv_seg.load_state_dict(head.conv_seg.state_dict())
        torch.testing.assert_close(bare(features), head.conv_seg(features))


def _train(module, features, targets, loss_fn, steps=300, lr=0.05):
    optimizer = torch.optim.Adam(module.parameters(), lr=lr)
    module.train()
    for _ in range(steps):
        optimizer.zero_grad()
        loss_fn(module(features), targets).backward()
        optimizer.step()
    return module.eval()


def _layer_outputs_with_signal(labels, means, *, depth=6, signal_block=-2, tokens=5, noise=0.5, seed=0):
    """Per-block (B, T, d) noise; the class token of one block carries the class mean of its label."""
    gen = torch.Generator().manual_seed(seed)
    dim = means.shape[1]
    outputs = [noise * torch.randn(len(labels), tokens, dim, generator=gen) for _ in range(depth)]
    outputs[signal_block][:, 0] += means[labels]
    return outputs


def test_linear_probe_learns_separable_class_tokens_and_only_from_the_blocks_it_reads():
    torch.manual_seed(0)
    classes, dim = 10, 16
    means = 2.0 * torch.randn(classes, dim)
    y_train, y_val = torch.randint(0, classes, (1000,)), torch.randint(0, classes, (500,))
    train = _layer_outputs_with_signal(y_train, means, seed=1)
    val = _layer_outputs_with_signal(y_val, means, seed=2)
    accuracy = {}
    for n in (4, 1):  # the class signal sits in the second-to-last block: the last 4 hold it, the last 1 does not
        head = LinearClassifier(class_token_dim(dim, n), classes)
        _train(head, class_token_features(train, n), y_train, torch.nn.functional.cross_entropy)
        with torch.no_grad():
            accuracy[n] = float((head(class_token_features(val, n)).argmax(1) == y_val).float().mean())
    assert accuracy[4] > 0.99
    assert accuracy[1] < 0.2  # chance is 0.1


@pytest.mark.parametrize("batch_norm", [True, False])
def test_linear_segmentation_probe_learns_separable_patches(batch_norm):
    torch.manual_seed(0)
    classes, dim, grid, patch = 4, 16, 6, 4
    means = 2.0 * torch.randn(classes + 1, dim)

    def sample(count, seed):
        gen = torch.Generator().manual_seed(seed)
        patch_classes = torch.randint(0, classes + 1, (count, grid, grid), generator=gen)  # class 4: "other"
        features = means[patch_classes].permute(0, 3, 1, 2) + 0.5 * torch.randn(count, dim, grid, grid, generator=gen)
        mask = patch_classes.repeat_interleave(patch, 1).repeat_interleave(patch, 2)  # each patch a 4x4 block
        mask[mask == classes] = IGNORE_INDEX
        return features, mask

    features, mask = sample(32, 1)
    head = LinearSegmentationHead(dim, classes, batch_norm=batch_norm)
    _train(head, features, mask, segmentation_loss, steps=200)  # the loss upsamples the patch-grid logits
    val_features, val_mask = sample(32, 2)
    with torch.no_grad():
        logits = head(val_features, size=val_mask.shape[-2:])
        patch_logits = head(val_features)
    assert logits.shape == (32, classes, grid * patch, grid * patch) and patch_logits.shape == (32, classes, grid, grid)
    # every patch right: the patch centres of the mask are the patch classes
    centres = confusion_matrix(patch_logits.argmax(1), val_mask[:, patch // 2:: patch, patch // 2:: patch], classes)
    assert mean_iou(centres) > 0.99
    # per pixel, bilinear upsampling decides the pixels at patch borders by the neighbouring margins: a few flip
    confusion = confusion_matrix(logits.argmax(1), val_mask, classes)
    assert mean_iou(confusion) > 0.9 and pixel_accuracy(confusion) > 0.95
    assert int(confusion.sum()) == int((val_mask != IGNORE_INDEX).sum())


# ---- loss and metrics against explicit counts ---------------------------------------------------------------------

def test_segmentation_loss_averages_over_the_pixels_not_ignored():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 4, 4)
    mask = torch.randint(0, 3, (2, 4, 4))
    mask[0, :2] = IGNORE_INDEX
    log_p = torch.log_softmax(logits, dim=1)
    terms = [-float(log_p[b, mask[b, i, j], i, j]) for b in range(2) for i in range(4) for j in range(4)
             if mask[b, i, j] != IGNORE_INDEX]
    assert float(segmentation_loss(logits, mask)) == pytest.approx(sum(terms) / len(terms), rel=1e-5)
    # coarse logits are upsampled to the mask: a constant 2x2 logit map gives the same loss at 4x4
    flat = torch.randn(1, 3, 1, 1).expand(1, 3, 2, 2)
    target = torch.full((1, 4, 4), 1)
    expected = -float(torch.log_softmax(flat[0, :, 0, 0], 0)[1])
    assert float(segmentation_loss(flat, target)) == pytest.approx(expected, rel=1e-5)
    assert float(segmentation_loss(logits, torch.full((2, 4, 4), IGNORE_INDEX))) == 0.0  # not NaN


def test_miou_matches_a_count_by_hand_with_ignored_pixels_and_absent_classes():
    # 5 classes. Class 3 is predicted but never in the target (IoU 0, counted); class 4 is in neither (left out);
    # the ignored pixels (255) predicted as 1 or 3 count for nothing.
    target = torch.tensor([[0, 0, 1, 1],
                           [0, 2, 1, 255],
                           [2, 2, 255, 255]])
    pred = torch.tensor([[0, 1, 1, 1],
                         [0, 2, 3, 1],
                         [2, 0, 3, 1]])
    # by hand over the 9 valid pixels:
    #   class 0: target at (0,0) (0,1) (1,0); predicted at (0,0) (1,0) (2,1) -> TP 2, FP 1, FN 1 -> 2/4
    #   class 1: target at (0,2) (0,3) (1,2); predicted at (0,1) (0,2) (0,3) -> TP 2, FP 1, FN 1 -> 2/4
    #   class 2: target at (1,1) (2,0) (2,1); predicted at (1,1) (2,0)       -> TP 2, FP 0, FN 1 -> 2/3
    #   class 3: target nowhere;            predicted at (1,2)               -> TP 0, FP 1, FN 0 -> 0/1
    #   class 4: nowhere                                                      -> 0/0, absent
    confusion = confusion_matrix(pred, target, num_classes=5)
    assert int(confusion.sum()) == 9
    iou = iou_per_class(confusion)
    assert iou[:4].tolist() == pytest.approx([0.5, 0.5, 2 / 3, 0.0])
    assert math.isnan(float(iou[4]))
    assert mean_iou(confusion) == pytest.approx((0.5 + 0.5 + 2 / 3 + 0.0) / 4)
    assert pixel_accuracy(confusion) == pytest.approx(6 / 9)


def test_confusion_matrix_matches_a_pixel_loop_and_halves_add_up_to_the_whole():
    gen = torch.Generator().manual_seed(0)
    classes = 6
    target = torch.randint(0, classes, (8, 10, 12), generator=gen)
    target[torch.rand(target.shape, generator=gen) < 0.2] = IGNORE_INDEX
    target[target == 5] = 4  # class 5 never in the target
    pred = torch.randint(0, classes - 1, target.shape, generator=gen)  # ... nor predicted
    loop = torch.zeros(classes, classes, dtype=torch.int64)
    for t, p in zip(target.flatten().tolist(), pred.flatten().tolist()):
        if t != IGNORE_INDEX:
            loop[t, p] += 1
    whole = confusion_matrix(pred, target, classes)
    assert whole.dtype == torch.int64 and torch.equal(whole, loop)
    halves = confusion_matrix(pred[:3], target[:3], classes) + confusion_matrix(pred[3:], target[3:], classes)
    assert torch.equal(halves, whole)
    per_class = [int(loop[c, c]) / int(loop[c].sum() + loop[:, c].sum() - loop[c, c]) for c in range(5)]
    assert mean_iou(halves) == pytest.approx(sum(per_class) / 5)  # class 5: absent from both, left out


def test_confusion_matrix_rejects_classes_out_of_range():
    with pytest.raises(ValueError, match="0..2"):
        confusion_matrix(torch.tensor([0, 3]), torch.tensor([0, 1]), num_classes=3)
    with pytest.raises(ValueError, match="0..2"):
        confusion_matrix(torch.tensor([0, 1]), torch.tensor([0, 7]), num_classes=3)
