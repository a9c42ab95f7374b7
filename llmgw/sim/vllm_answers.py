"""What vLLM 0.32 answers, in its shapes: the fake engine's vLLM mode builds its bodies here.

Held to the real server by tests/test_fake_vllm_vs_real.py (the same requests to both, the
same status codes and shapes; recorded in tests/samples/vllm-0.32.0-answers.json). The
values are the fake's own (its tokens, its counts); the keys, the nulls, the error types
and the order of a stream's events are vLLM's.
"""

from __future__ import annotations

from dataclasses import dataclass

CHARS_PER_TOKEN = 4  # the fake's tokens (fake_engine.tokenize)


@dataclass(frozen=True)
class Refusal:
    status: int
    body: dict


def error(status: int, message: str, kind: str, param: str | None = None) -> dict:
    """Every error vLLM's OpenAI server answers (FastAPI's own 404/405 aside)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def invalid_body(loc: str, kind: str, msg: str, what: str) -> Refusal:
    """pydantic's refusal of a request body, as vLLM words it (type "Bad Request")."""
    detail = f"{{'type': '{kind}', 'loc': '{loc}', 'msg': '{msg}', 'input': '{what}'}}"
    return Refusal(400, error(400, f"1 validation error:\n  {detail}", "Bad Request", loc))


def _described(value: object) -> str:
    if isinstance(value, dict):
        return f"<dict of {len(value)} items>"
    if isinstance(value, list):
        return f"<list of {len(value)} items>"
    return repr(value)


def not_json(at: int) -> Refusal:
    """A body that is not JSON, its decoding failing at character `at`."""
    return invalid_body(f"body.{at}", "json_invalid", "JSON decode error", "<dict of 0 items>")


def refusal(
    body: object, *, chat: bool, served: str, context: int, prompt_chars: int
) -> Refusal | None:
    """Why vLLM refuses this completion request before generating, in its order: the body's
    shape, the model, the prompt, the prompt's length, then max_tokens."""
    if not isinstance(body, dict):
        return invalid_body(
            "body",
            "model_attributes_type",
            "Input should be a valid dictionary or object to extract fields from",
            _described(body),
        )
    if chat and "messages" not in body:
        return invalid_body("body.messages", "missing", "Field required", _described(body))
    if chat and not isinstance(body["messages"], list):
        return invalid_body(
            "body.messages", "list_type", "Input should be a valid list", str(body["messages"])
        )
    model = body.get("model")
    if model is not None and model != served:
        return Refusal(
            404,
            error(
                404,
                f"The model `{model}` does not exist. Valid aliases: {served}.",
                "NotFoundError",
                "model",
            ),
        )
    if chat and not body["messages"]:
        return Refusal(
            400,
            error(
                400,
                "Cannot apply chat template to an empty conversation. Provide at least one message.",
                "BadRequestError",
            ),
        )
    if not chat and not body.get("prompt"):
        return Refusal(
            400,
            error(
                400,
                "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
                "BadRequestError",
                "prompt",
            ),
        )
    # vLLM refuses by characters first: more than its tokenizer's longest token times the
    # context cannot fit. The fake's tokens are 4 characters each, so this is exactly its
    # "more tokens than the context" too, and vLLM's token count check is never reached.
    if prompt_chars > CHARS_PER_TOKEN * context:
        return Refusal(
            400,
            error(
                400,
                f"This model's maximum context length is {context} tokens. However, your "
                f"prompt contains {prompt_chars} characters (more than "
                f"{CHARS_PER_TOKEN * context} characters, which is the upper bound for "
                f"{context} input tokens). Please reduce the length of the input prompt. "
                f"(parameter=input_text, value={prompt_chars})",
                "BadRequestError",
                "input_text",
            ),
        )
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, int) and max_tokens < 1:
        return Refusal(
            400,
            error(
                400,
                f"max_tokens must be at least 1, got {max_tokens}. "
                f"(parameter=max_tokens, value={max_tokens})",
                "BadRequestError",
                "max_tokens",
            ),
        )
    if isinstance(max_tokens, int) and max_tokens > context:
        return Refusal(
            400,
            error(
                400,
                f"max_tokens={max_tokens} cannot be greater than max_model_len={context}. "
                f"Please request fewer output tokens. (parameter=max_tokens, value={max_tokens})",
                "BadRequestError",
                "max_tokens",
            ),
        )
    return None


def model_entry(served: str, root: str, context: int, created: int) -> dict:
    """One entry of /v1/models."""
    return {
        "id": served,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": root,
        "parent": None,
        "max_model_len": context,
        "permission": [
            {
                "id": f"modelperm-{created:016x}",
                "object": "model_permission",
                "created": created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }


def fingerprint() -> str:
    return "vllm-0.32.0-fake0000"


def stream_usage(prompt: int, completion: int) -> dict:
    """A stream's usage (stream_options.include_usage): no details, unlike a whole answer."""
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }


def usage(prompt: int, completion: int) -> dict:
    return {
        **stream_usage(prompt, completion),
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def chat_delta(text: str | None, finish: str | None, index: int = 0, *, role: bool = False) -> dict:
    """A chat stream's choice: the first carries the role and empty content, the last its
    finish reason (and its token) with a stop_reason."""
    choice: dict = {
        "index": index,
        "delta": {"role": "assistant", "content": ""} if role else {"content": text or ""},
        "logprobs": None,
        "finish_reason": finish,
    }
    if finish is not None:
        choice["stop_reason"] = None
    if not role:
        choice["token_ids"] = None
    return choice


def text_delta(text: str, finish: str | None, index: int = 0) -> dict:
    return {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": None,
        "prompt_token_ids": None,
        "token_ids": None,
    }


def chunk(rid: str, created: int, model: str, choice: dict, *, chat: bool) -> dict:
    data = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if chat and "role" in choice.get("delta", {}):
        data.update(prompt_token_ids=None, prompt_text=None)
    return data


def last_chunk(event: dict) -> dict:
    """A stream without usage ends its last event with the fingerprint (the usage event
    carries it otherwise)."""
    return {**event, "system_fingerprint": fingerprint()}


def usage_chunk(rid: str, created: int, model: str, used: dict, *, chat: bool) -> dict:
    return {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": used,
        "system_fingerprint": fingerprint(),
    }


def whole(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish: str,
    used: dict,
    copies: int = 1,
    *,
    chat: bool,
) -> dict:
    """A whole (not streamed) answer, of `copies` choices alike (the request's `n`)."""
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [_whole_choice(text, finish, c, chat=chat) for c in range(copies)],
        "service_tier": None,
        "system_fingerprint": fingerprint(),
        "usage": used,
        **(
            {"prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None} if chat else {}
        ),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def _whole_choice(text: str, finish: str, index: int, *, chat: bool) -> dict:
    if chat:
        message = {
            "role": "assistant",
            "content": text,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "reasoning": None,
        }
        choice: dict = {"index": index, "message": message, "logprobs": None}
        choice.update(finish_reason=finish, stop_reason=None, token_ids=None, routed_experts=None)
        return choice
    return {**text_delta(text, finish, index), "prompt_logprobs": None, "routed_experts": None}
