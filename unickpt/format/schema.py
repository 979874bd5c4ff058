"""Export the index JSON schema that ``docs/index.schema.json`` holds.

``python -m unickpt.format.schema > docs/index.schema.json`` regenerates it; a test fails
when the file and the pydantic models drift apart.
"""

from __future__ import annotations

import json
import sys

from unickpt.format.index_models import KNOWN_FORMAT_VERSIONS, IndexFile

__all__ = ["index_schema_json"]


def index_schema_json() -> str:
    schema = IndexFile.model_json_schema(mode="validation")
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = (
        f"unickpt checkpoint index (format versions {', '.join(map(str, KNOWN_FORMAT_VERSIONS))})"
    )
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    sys.stdout.write(index_schema_json())
