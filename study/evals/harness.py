"""A lapstudy GPT as a model of EleutherAI's lm-evaluation-harness (`lm_eval`), registered as "lapstudy".

`LapstudyLM` wraps a GPT (models/gpt.py) and the tokenizer it was trained with (study/data/text.py: UTF-8 bytes or
GPT-2 BPE), built in memory or loaded from a run config and its checkpoint (study/evals/load.py), and answers the
harness's three kinds of request:

- `loglikelihood`: log p(continuation | context) summed over the continuation's tokens, and whether each of them is
  the argmax (is_greedy). Context and continuation are tokenised together and split as the harness does
  (`TemplateLM._encode_pair`); an empty context is conditioned on end-of-text, the separator the training stream puts
  before every document, and every context starts with it (a document start, as in training, like a BOS token).
  The window is left-truncated to the model's context length. Requests go through the model
  in batches, longest first, right-padded (a causal model's earlier positions never see the padding).
- `loglikelihood_rolling`: a text's whole log-likelihood over disjoint windows of the context length
  (`lm_eval.utils.get_rolling_token_windows`), each conditioned on the token before it.
- `generate_until`: `model.generate` (a decoding cache) in chunks, stopping at the first stop sequence, at
  end-of-text or after `max_gen_toks` tokens; greedy unless `do_sample` with a temperature > 0 (`top_k` honoured).
  A model whose mixers keep no decoding state (STLT) is decoded by a forward over the whole window per token.

`apply_chat_template` renders a conversation with a Jinja template (the adapter's `chat_template`, default a plain
"User: ... / Assistant:" format): lapstudy's models are base models with no chat format of their own.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from models.gpt import sample_next_token
from study.evals.load import load_model
from study.evals.text_tokenizer import TextTokenizer

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


@register_model("lapstudy")
class LapstudyLM(TemplateLM):
    """`model`: a GPT (or a path is given instead: `config` a run config, `checkpoint` its checkpoint); `tokenizer`:
    the project's Tokenizer (or TextTokenizer). With `lm_eval --model lapstudy --model_args config=...,checkpoint=...`
    the harness builds it from strings."""

    def __init__(self, model=None, tokenizer=None, *, config: str | None = None, checkpoint: str | None = None,
                 batch_size: int | str = 16, device: str | None = None, chat_template: str | None = None,
                 generation_chunk: int = 32, seed: int = 0, **_ignored):
        super().__init__()
        if model is None:
            if config is None and checkpoint is None:
                raise ValueError("lapstudy model: give `model` and `tokenizer`, or `config` (and `checkpoint`)")
            model, tokenizer, _ = load_model(config, checkpoint)
        if tokenizer is None:
            raise ValueError("lapstudy model: `tokenizer` is required with an in-memory model")
        self.text = tokenizer if isinstance(tokenizer, TextTokenizer) else TextTokenizer(tokenizer)
        if self.text.vocab_size > model.config.vocab_size:
            raise ValueError(f"tokenizer {self.text.name} has {self.text.vocab_size} tokens but the model's "
                             f"vocab_size is {model.config.vocab_size}")
        self._device = torch.device(device) if device else next(model.parameters()).device
        self.model = model.to(self._device).eval()
        self.max_length = model.config.context_length
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 16
        self.template = chat_template or DEFAULT_CHAT_TEMPLATE
        self.generation_chunk = generation_chunk
        self.generator = torch.Generator(device=self._device).manual_seed(seed)

    # ---- what TemplateLM asks for ---------------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.text.eot

    @property
    def device(self):
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return f"lapstudy-{self.text.name}"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.text.encode(string)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.text.decode(tokens)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.template if chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        import jinja2

        return jinja2.Template(self.template).render(messages=chat_history,
                                                     add_generation_prompt=add_generation_prompt)

    # ---- scoring --------------------------------------------------------------------------------------------------

    def _autocast(self):
        if self._device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return nullcontext()

    @torch.no_grad()
    def score_tokens(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log p(continuation token | everything before it), every continuation token is the argmax) of each
        (context ids, continuation ids) pair; the window is the last context_length + 1 tokens."""
        results: list[tuple[float, bool] | None] = [None] * len(pairs)
        windows = []
        for index, (context, continuation) in enumerate(pairs):
            if not continuation:
                results[index] = (0.0, True)
                continue
            if not context:
                raise ValueError("loglikelihood: a continuation needs at least one context token")
            whole = (context + continuation)[-(self.max_length + 1):]
            windows.append((index, whole[:-1], min(len(continuation), len(whole) - 1), continuation))
        windows.sort(key=lambda w: -len(w[1]))  # longest first: similar lengths share a batch
        for start in range(0, len(windows), self.batch_size):
            batch = windows[start:start + self.batch_size]
            width = len(batch[0][1])
            inputs = torch.zeros((len(batch), width), dtype=torch.long)
            for row, (_, ids, _, _) in enumerate(batch):
                inputs[row, :len(ids)] = torch.tensor(ids)
            with self._autocast():
                logits = self.model(inputs.to(self._device))  # (B, width, vocab)
            logprobs = F.log_softmax(logits.float(), dim=-1)
            for row, (index, ids, scored, continuation) in enumerate(batch):
                # the logits at position t predict token t + 1: the last `scored` inputs predict the continuation
                rows = logprobs[row, len(ids) - scored:len(ids)]  # (scored, vocab)
                target = torch.tensor(continuation[-scored:], device=rows.device)
                total = rows.gather(1, target[:, None]).sum().item()
                greedy = bool((rows.argmax(dim=-1) == target).all())
                results[index] = (total, greedy)
        return results

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        results = self.score_tokens([(self._with_document_start(context), continuation)
                                     for _, context, continuation in requests])
        for (key, _, _), result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        totals = []
        for request in requests:
            (text,) = request.args
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.eot_token_id, max_seq_len=self.max_length,
                context_len=1)]
            total = sum(logprob for logprob, _ in self.score_tokens(windows))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            totals.append(total)
        return totals

    # ---- generation -----------------------------------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        outputs = []
        for request in requests:
            context, gen_kwargs = request.args
            text = self.generate(context, **(gen_kwargs or {}))
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            outputs.append(text)
        return outputs

    @torch.no_grad()
    def generate(self, context: str, until: str | list[str] | None = None, max_gen_toks: int = 256,
                 do_sample: bool = False, temperature: float = 0.0, top_k: int | None = None, **_ignored) -> str:
        """The text generated after `context`, cut before the first of `until` (the harness's gen_kwargs)."""
        stops = [until] if isinstance(until, str) else list(until or [])
        temperature = float(temperature) if do_sample or temperature else 0.0
        if do_sample and temperature == 0.0:
            temperature = 1.0  # do_sample without a temperature: the harness's (and HF's) default
        keep = max(1, self.max_length - max_gen_toks)
        ids = torch.tensor([self._with_document_start(self.tok_encode(context))[-keep:]], device=self._device)
        new: list[int] = []
        while len(new) < max_gen_toks:
            steps = min(self.generation_chunk, max_gen_toks - len(new), self.max_length - 1)
            window = ids[:, -(self.max_length - steps):]
            with self._autocast():
                out = self._decode(window, steps, temperature, top_k)
            chunk = out[0, window.shape[1]:].tolist()
            ids = torch.cat([ids, out[:, window.shape[1]:]], dim=1)
            if self.eot_token_id in chunk:
                new += chunk[:chunk.index(self.eot_token_id)]
                break
            new += chunk
            if stops and any(stop in self.tok_decode(new) for stop in stops):
                break
        return _cut_at_stops(self.tok_decode(new), stops)

    def _with_document_start(self, ids: list[int]) -> list[int]:
        """End-of-text before the text, as training packs every document after one (it is the model's BOS)."""
        return ids if ids[:1] == [self.eot_token_id] else [self.eot_token_id] + ids

    def _decode(self, window: torch.Tensor, steps: int, temperature: float, top_k: int | None) -> torch.Tensor:
        try:
            return self.model.generate(window, steps, temperature=temperature, top_k=top_k, generator=self.generator)
        except NotImplementedError:  # a mixer without a decoding state: a forward over the whole window per token
            for _ in range(steps):
                logits = self.model(window[:, -self.max_length:])[:, -1].float()
                window = torch.cat([window, sample_next_token(logits, temperature, top_k, self.generator)], dim=1)
            return window


def _cut_at_stops(text: str, stops: list[str]) -> str:
    cut = min((text.index(stop) for stop in stops if stop and stop in text), default=len(text))
    return text[:cut]
