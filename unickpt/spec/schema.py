"""Export the index JSON schema that ``docs/index.schema.json`` holds.

``python -m unickpt.spec.schema > docs/index.schema.json`` regenerates it; a test fails
when the file and the pydantic models drift apart.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from unickpt.spec.dtypes import DTYPE_ITEMSIZE
from unickpt.spec.index import B64_DIGEST_LEN, FORMAT_VERSION, NO_DIGEST, IndexFile

# One digest in the text form: 11 base64url characters, the last one's 2 low bits 0.
_B64 = f"[A-Za-z0-9_-]{{{B64_DIGEST_LEN - 1}}}[AEIMQUYcgkosw048]"

__all__ = ["index_schema_json"]


def index_schema_json() -> str:
    schema = IndexFile.model_json_schema(mode="validation")
    _text_form(schema["$defs"])
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = f"unickpt checkpoint index (format version {FORMAT_VERSION})"
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def _text_form(defs: dict[str, Any]) -> None:
    """The models describe the in-memory form (16 hex digits per digest, a dtype per tensor); the
    JSON (docs/format.md 3.2) has base64url digests and a default dtype: say so."""
    defs["UnickptBlock"]["properties"]["dtype"] = {
        "description": "the dtype of every tensor that has none (the most frequent one)",
        "enum": sorted(DTYPE_ITEMSIZE),
        "title": "Dtype",
        "type": "string",
    }
    tensor = defs["TensorEntry"]
    tensor["required"] = [k for k in tensor["required"] if k != "dtype"]
    props = tensor["properties"]
    props["dtype"]["description"] = "absent: the block's dtype"
    props["fingerprint"]["anyOf"][0]["pattern"] = f"^{_B64}$"
    props["fingerprint"]["description"] += " (11 base64url characters)"
    props["xxh3"]["anyOf"][0]["pattern"] = f"^({_B64}|{NO_DIGEST})*$"
    props["xxh3"]["description"] = (
        f"compact: the slice hashes, 11 base64url characters each ({NO_DIGEST!r}: none)"
    )


if __name__ == "__main__":
    sys.stdout.write(index_schema_json())
