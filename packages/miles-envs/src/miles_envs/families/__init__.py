"""Model families for token-in-token-out sessions: template, parsers and boundary rules, by name.

See ``docs/model-families.md``. Importing this package loads no tokenizer library.
"""

from miles_envs.families.base import FamilyArtefactError, FamilyError, ModelFamily, ParsedReply, TemplateEdit
from miles_envs.families.registry import (
    GENERIC,
    check_family_name,
    get_family,
    is_registered,
    register_family,
    registered_families,
)

__all__ = [
    "GENERIC",
    "FamilyArtefactError",
    "FamilyError",
    "ModelFamily",
    "ParsedReply",
    "TemplateEdit",
    "check_family_name",
    "get_family",
    "is_registered",
    "register_family",
    "registered_families",
]
