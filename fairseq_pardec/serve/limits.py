"""What one request may ask, and the HTTP error each limit answers with.

Every refusal is a :class:`Refused`: a status, one message that names the limit and the flag
that sets it, and the headers it needs (Retry-After on 503). The app turns it into one JSON body,
``{"error": {"status", "message", "flag", "limit"}}``; nothing else of the server changes.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, ValidationError


class Refused(Exception):
    def __init__(self, status: int, message: str, flag: Optional[str] = None,
                 limit: Optional[float] = None, headers: Optional[Dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.flag, self.limit = status, message, flag, limit
        self.headers = headers or {}

    def body(self) -> dict:
        error = {"status": self.status, "message": self.message}
        if self.flag:
            error["flag"] = self.flag
        if self.limit is not None:
            error["limit"] = self.limit
        return {"error": error}


class TranslateBody(BaseModel):
    """``POST /translate``'s JSON body."""

    model_config = ConfigDict(extra="forbid")

    text: Union[StrictStr, List[StrictStr]] = Field(
        description="one text, or a list of texts decoded in order")
    timeout_ms: Optional[float] = Field(
        default=None, gt=0, description="answer 504 past this many ms (at most --request-timeout)")
    return_tokens: StrictBool = Field(
        default=False, description="each output's tokens before BPE and tokenizer decoding")
    return_score: StrictBool = Field(
        default=False, description="each output's score and per-token scores (base 2)")
    return_timing: StrictBool = Field(default=False, description="the request's timing in ms")
    return_edits: StrictBool = Field(
        default=False, description="each output's word edits against its text")


@dataclass
class Limits:
    max_texts: int
    max_request_bytes: int
    request_timeout_s: float
    source_limit: Optional[int]  # source tokens the model takes, EOS included

    @classmethod
    def from_args(cls, args, model):
        return cls(max_texts=args.max_texts, max_request_bytes=args.max_request_bytes,
                   request_timeout_s=args.request_timeout, source_limit=model.source_limit)

    def body_too_large(self, size: int) -> Refused:
        return Refused(413, "the request body has %s bytes, more than the %d that "
                       "--max-request-bytes allows" % (size if size >= 0 else "more", self.max_request_bytes),
                       "--max-request-bytes", self.max_request_bytes)

    def parse(self, raw: bytes) -> TranslateBody:
        """The body, checked: 400 for malformed or empty input, 413 for too many texts."""
        try:
            body = TranslateBody.model_validate_json(raw)
        except ValidationError as error:
            first = error.errors()[0]
            location = [str(part) for part in first.get("loc", ())]
            if first.get("type") == "json_invalid":
                raise Refused(400, "the body is not JSON: %s" % first.get("msg")) from None
            if location[:1] == ["text"]:  # a union's errors name the branch tried: say both
                raise Refused(400, "text must be a string or a list of strings (want "
                              "{\"text\": \"...\"} or {\"text\": [\"...\", ...]})") from None
            raise Refused(400, "%s: %s" % (".".join(location) or "body", first.get("msg"))) from None
        texts = self.texts(body)
        if not texts:
            raise Refused(400, "text: an empty list; give at least one text")
        for i, text in enumerate(texts):
            if not text.strip():
                raise Refused(400, "text%s is empty; give something to decode"
                              % ("" if isinstance(body.text, str) else "[%d]" % i))
        if len(texts) > self.max_texts:
            raise Refused(413, "%d texts in one request, more than the %d that --max-texts allows; "
                          "split the request" % (len(texts), self.max_texts),
                          "--max-texts", self.max_texts)
        return body

    @staticmethod
    def texts(body: TranslateBody) -> List[str]:
        return [body.text] if isinstance(body.text, str) else list(body.text)

    def timeout_s(self, body: TranslateBody) -> float:
        asked = self.request_timeout_s if body.timeout_ms is None else body.timeout_ms / 1000.0
        return min(asked, self.request_timeout_s)

    def too_long(self, index: int, tokens: int, single: bool) -> Refused:
        return Refused(413, "text%s has %d source tokens (EOS included), more than the %d the "
                       "model takes (--max-source-positions); shorten it, or start the server "
                       "with --truncate-source to cut long texts"
                       % ("" if single else "[%d]" % index, tokens, self.source_limit),
                       "--max-source-positions", self.source_limit)


def queue_full(error) -> Refused:
    return Refused(503, str(error), "--max-pending-rows",
                   headers={"Retry-After": str(error.retry_after)})


def draining() -> Refused:
    return Refused(503, "the server is shutting down (SIGTERM) and takes no new requests; send "
                   "it to another replica", headers={"Retry-After": "1", "Connection": "close"})


def deadline(timeout_s: float, from_request: bool) -> Refused:
    flag = "timeout_ms" if from_request else "--request-timeout"
    return Refused(504, "the request was not decoded within %.3g s (%s)" % (timeout_s, flag),
                   flag, timeout_s)
