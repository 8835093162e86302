"""Chat messages through the model's chat template, tokenized: what chat completions and the chat
form of /tokenize both send the model, so they count the same tokens.

Its own module, imported by both endpoints (chat.py, tokenization.py), neither of which imports
the other. Renders as vLLM does: developer messages join the system message, the request's
template variables, then its two flags over them; no special tokens beyond the template's own.
"""
from __future__ import annotations

from pagedserve.services.router.context import RouterContext
from pagedserve.services.router.errors import bad_request
from pagedserve.services.router.openai_schema import ChatTemplateFields

# OpenAI's roles; "assistant" and "tool" content may be empty (a tool call without text).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# "developer" is OpenAI's newer name for "system"; chat templates know only the old one. As vLLM
# renders them, developer messages join the leading system message (one is made when there is
# none), wherever they stand in the conversation, separated by blank lines.
DEVELOPER_JOIN = "\n\n"

# apply_chat_template's arguments that change the call, not what the template sees (vLLM refuses
# chat_template and tokenize; the others would change the type of what comes back). Template
# inputs such as tools and documents pass, as in vLLM.
TEMPLATE_CALL_ARGS = frozenset({"conversation", "chat_template", "tokenize", "padding", "truncation",
                                "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                                "tokenizer_kwargs"})


def message_text(content) -> str:
    """A message's content as text: its string, or its text parts joined (chat's echo reads it too)."""
    if isinstance(content, list):
        return "\n".join(p.text or "" for p in content)     # as vLLM joins text parts
    return content or ""


def render_prompt(ctx: RouterContext, req: ChatTemplateFields) -> list[int]:
    """The messages through the model's chat template, tokenized (chat completions, /tokenize)."""
    if req.continue_final_message and req.add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                          "continue_final_message")
    messages = []
    for i, m in enumerate(req.messages):
        if m.role not in CHAT_ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {m.role!r}",
                              f"messages[{i}].role")
        if m.content is None and m.role in ("system", "user", "developer"):
            raise bad_request(f"messages[{i}] ({m.role}) needs content", f"messages[{i}].content")
        if isinstance(m.content, list) and any(p.type != "text" for p in m.content):
            raise bad_request("only text content parts are supported", f"messages[{i}].content")
        messages.append({"role": m.role, "content": message_text(m.content)})
    messages = _developer_as_system(messages)
    tok = ctx.info.tokenizer
    if not getattr(tok, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    # As vLLM merges them: the request's template variables, then its two flags over them.
    kwargs = {**(req.chat_template_kwargs or {}), "add_generation_prompt": req.add_generation_prompt,
              "continue_final_message": req.continue_final_message}
    if set(kwargs) & TEMPLATE_CALL_ARGS:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(sorted(set(kwargs) & TEMPLATE_CALL_ARGS))}",
                          "chat_template_kwargs")
    try:
        text = tok.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception as e:  # jinja raises its own types for templates that reject the messages
        raise bad_request(f"the chat template could not render these messages: {e}", "messages") from None
    # As vLLM: no special tokens beyond the template's own unless the client asks (templates write the BOS).
    return ctx.tokenize(text, add_special_tokens=bool(req.add_special_tokens), param="messages")


def _developer_as_system(messages: list[dict]) -> list[dict]:
    developer = [m["content"] for m in messages if m["role"] == "developer"]
    if not developer:
        return messages
    rest = [m for m in messages if m["role"] != "developer"]
    if rest and rest[0]["role"] == "system":
        return [{"role": "system", "content": DEVELOPER_JOIN.join([rest[0]["content"], *developer])}, *rest[1:]]
    return [{"role": "system", "content": DEVELOPER_JOIN.join(developer)}, *rest]
