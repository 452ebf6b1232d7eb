"""Greedy decoding and batched beam search with a length penalty over a model's cached decoding steps.

The model offers (models/encdec.py, `EncoderDecoder`):
    encode(src_tokens) -> memory;  repeat_memory(memory, times) -> memory;  init_decoder_state(memory) -> state
    decode_step(tokens (B,), state) -> (logits (B, V), state);  reorder_decoder_state(state, index) -> state

Hypotheses: the tokens generated after BOS, ending with EOS, at most ``max_len`` of them (EOS included; at the last
step only EOS is allowed, so every hypothesis ends). Padding is never generated, nor BOS unless it is EOS. A
hypothesis y of length |y| scores log P(y | x) / lp(|y|), the length penalty being

    "gnmt"     lp = ((5 + |y|) / 6) ** alpha      (Wu et al. 2016, GNMT; the default)
    "fairseq"  lp = |y| ** alpha                  (fairseq's lenpen)

GNMT's is the default because it is the one Vaswani et al.'s alpha = 0.6 refers to: they decoded with
tensor2tensor, whose beam search divides by ((5 + length) / 6) ** alpha.

Beam search (fairseq's sequence_generator.py, vectorised over the batch): each step ranks the 2K best extensions of
the K live hypotheses; the EOS-ending ones among the first K ranks are finished, the best K others live on. A
sentence is done once it has K finished hypotheses (or none live), and its result is the finished hypothesis with
the best score. With K = 1 this is greedy decoding; with K at least the number of extensions of every step it
scores every hypothesis (tests/test_beam_search.py checks both).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

PENALTIES = ("gnmt", "fairseq")


class SearchOutput(NamedTuple):
    tokens: torch.Tensor  # (B, max_len): the generated tokens (no BOS), EOS, then pad_id
    lengths: torch.Tensor  # (B,) tokens generated, EOS included
    log_probs: torch.Tensor  # (B,) log P(tokens | source)
    scores: torch.Tensor  # (B,) log_probs / length penalty (greedy: the same penalty, for comparison)


def length_penalty(length: torch.Tensor, alpha: float, kind: str = "gnmt") -> torch.Tensor:
    """lp(|y|) as a float tensor: ((5 + |y|) / 6) ** alpha (gnmt) or |y| ** alpha (fairseq)."""
    if kind not in PENALTIES:
        raise ValueError(f"length penalty: must be one of {', '.join(PENALTIES)}, got {kind!r}")
    length = length.to(torch.float64) if isinstance(length, torch.Tensor) else torch.tensor(float(length))
    return ((5 + length) / 6) ** alpha if kind == "gnmt" else length ** alpha


def _step_log_probs(model, tokens, state, t: int, max_len: int, banned: list[int], eos_id: int):
    logits, state = model.decode_step(tokens, state)
    log_probs = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    log_probs[:, banned] = float("-inf")
    if t == max_len - 1:  # the last step may only end the hypothesis
        eos = log_probs[:, eos_id].clone()
        log_probs.fill_(float("-inf"))
        log_probs[:, eos_id] = eos
    return log_probs, state


def _banned(bos_id: int, eos_id: int, pad_id: int) -> list[int]:
    return sorted({pad_id} | ({bos_id} if bos_id != eos_id else set()))


@torch.no_grad()
def greedy_search(model, src_tokens: torch.Tensor, *, bos_id: int, eos_id: int, pad_id: int, max_len: int,
                  src_padding_mask: torch.Tensor | None = None, alpha: float = 0.0,
                  penalty: str = "gnmt") -> SearchOutput:
    """The most probable next token at every step until EOS (or max_len), for a batch of sources (B, Ns)."""
    B, device = src_tokens.shape[0], src_tokens.device
    banned = _banned(bos_id, eos_id, pad_id)
    state = model.init_decoder_state(model.encode(src_tokens, src_padding_mask))
    out = torch.full((B, max_len), pad_id, dtype=torch.long, device=device)
    log_prob = torch.zeros(B, dtype=torch.float64, device=device)
    lengths = torch.zeros(B, dtype=torch.long, device=device)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    prev = torch.full((B,), bos_id, dtype=torch.long, device=device)
    for t in range(max_len):
        step_lp, state = _step_log_probs(model, prev, state, t, max_len, banned, eos_id)
        token = step_lp.argmax(dim=-1)
        live = ~finished
        log_prob += torch.where(live, step_lp.gather(1, token[:, None])[:, 0].double(), 0.0)
        lengths += live.long()
        token = torch.where(live, token, pad_id)
        out[:, t] = token
        finished |= token == eos_id
        prev = token
        if finished.all():
            break
    scores = log_prob / length_penalty(lengths, alpha, penalty)
    return SearchOutput(out, lengths, log_prob, scores)


@torch.no_grad()
def beam_search(model, src_tokens: torch.Tensor, *, beam_size: int = 4, alpha: float = 0.6, penalty: str = "gnmt",
                bos_id: int, eos_id: int, pad_id: int, max_len: int,
                src_padding_mask: torch.Tensor | None = None) -> SearchOutput:
    """The best-scoring hypothesis per source (B, Ns) found by a beam of ``beam_size`` (module docstring).
    Transformer-base's setting is beam_size=4, alpha=0.6, penalty="gnmt"."""
    if beam_size < 1 or max_len < 1:
        raise ValueError(f"beam_size and max_len must be >= 1, got {beam_size} and {max_len}")
    length_penalty(1, alpha, penalty)  # checks the kind
    B, K, device = src_tokens.shape[0], beam_size, src_tokens.device
    banned = _banned(bos_id, eos_id, pad_id)
    memory = model.repeat_memory(model.encode(src_tokens, src_padding_mask), K)
    state = model.init_decoder_state(memory)
    inf = float("-inf")
    # Live hypotheses, row b * K + j for beam j of sentence b: their tokens and log-probabilities. Only beam 0 lives
    # at the start, so the first step's K best come from one hypothesis, not K copies of it.
    tokens = torch.full((B * K, max_len), pad_id, dtype=torch.long, device=device)
    live_lp = torch.full((B, K), inf, dtype=torch.float64, device=device)
    live_lp[:, 0] = 0
    # Finished hypotheses, up to K per sentence, in the order they finish.
    fin_tokens = torch.full((B, K, max_len), pad_id, dtype=torch.long, device=device)
    fin_lp = torch.full((B, K), inf, dtype=torch.float64, device=device)
    fin_score = torch.full((B, K), inf, dtype=torch.float64, device=device)
    fin_len = torch.zeros(B, K, dtype=torch.long, device=device)
    n_fin = torch.zeros(B, dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    prev = torch.full((B * K,), bos_id, dtype=torch.long, device=device)
    rows = torch.arange(B, device=device)[:, None]

    for t in range(max_len):
        step_lp, state = _step_log_probs(model, prev, state, t, max_len, banned, eos_id)
        V = step_lp.shape[-1]
        candidates = (live_lp[:, :, None] + step_lp.double().view(B, K, V)).view(B, K * V)
        candidates[done] = inf
        n_cand = min(2 * K, K * V)
        cand_lp, cand_index = candidates.topk(n_cand, dim=1)  # (B, 2K), best first
        cand_beam, cand_token = cand_index // V, cand_index % V
        alive = torch.isfinite(cand_lp)
        is_eos = (cand_token == eos_id) & alive

        # Finish the EOS candidates among the first K ranks, in rank order, into the free slots.
        finishing = is_eos.clone()
        finishing[:, K:] = False
        slot = n_fin[:, None] + finishing.long().cumsum(dim=1) - 1
        finishing &= slot < K
        if finishing.any():
            b, r = finishing.nonzero(as_tuple=True)
            s = slot[b, r]
            src_row = b * K + cand_beam[b, r]
            fin_tokens[b, s] = tokens[src_row]
            fin_tokens[b, s, t] = eos_id
            fin_lp[b, s] = cand_lp[b, r]
            fin_len[b, s] = t + 1
            fin_score[b, s] = cand_lp[b, r] / length_penalty(t + 1, alpha, penalty)
            n_fin += finishing.sum(dim=1)

        # The K best candidates that do not end live on (ranks kept in order); missing ones are dead (-inf).
        goes_on = alive & ~is_eos
        order = torch.where(goes_on, torch.arange(n_cand, device=device), n_cand + torch.arange(n_cand, device=device))
        pick = order.argsort(dim=1)[:, :K]
        if pick.shape[1] < K:  # fewer candidates than beams (a tiny vocabulary): pad with dead ones
            pick = torch.cat((pick, pick[:, -1:].expand(B, K - pick.shape[1])), dim=1)
            kept = torch.zeros(B, K, dtype=torch.bool, device=device)
            kept[:, :n_cand] = goes_on.gather(1, pick[:, :n_cand])
        else:
            kept = goes_on.gather(1, pick)
        live_lp = torch.where(kept, cand_lp.gather(1, pick), inf)
        source = rows * K + cand_beam.gather(1, pick)  # (B, K) rows of the hypotheses extended
        new_token = torch.where(kept, cand_token.gather(1, pick), pad_id)
        index = source.view(-1)
        tokens = tokens.index_select(0, index)
        tokens[:, t] = new_token.view(-1)
        state = model.reorder_decoder_state(state, index)
        prev = new_token.view(-1)

        done |= (n_fin >= K) | ~kept.any(dim=1)
        if done.all():
            break

    best = fin_score.argmax(dim=1)
    b = torch.arange(B, device=device)
    return SearchOutput(fin_tokens[b, best], fin_len[b, best], fin_lp[b, best], fin_score[b, best])
