"""``miles check-family NAME``: is a model family's template append-only for the session server?"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click

from miles.cli._common import verbose_option

if TYPE_CHECKING:
    from miles_envs.families.check import FamilyReport


def _table(report: FamilyReport) -> list[str]:
    verified = "verified" if report.template_verified else "NOT in the family's verified templates"
    lines = [
        f"family {report.family}: {report.tokenizer}",
        f"  template sha256 {report.template_sha256[:16]}… ({verified})",
    ]
    if report.stand_in:
        lines.append(f"  stand-in tokenizer: {report.stand_in}")
    if report.notes:
        lines.append(f"  note: {report.notes}")
    if report.tokenizer_problem:
        lines.append(f"  TOKENIZER PROBLEM: {report.tokenizer_problem}")
    width = max((len(case.case) for case in report.cases), default=4)
    edited = any(case.official_append_only is not None for case in report.cases)
    header = f"  {'CASE'.ljust(width)}  RESULT  TURNS" + ("  OFFICIAL TEMPLATE" if edited else "")
    lines.append(header)
    for case in report.cases:
        row = f"  {case.case.ljust(width)}  {case.status.upper().ljust(6)}  {str(case.turns).rjust(5)}"
        if edited and case.official_append_only is not None:
            row += "  append-only" if case.official_append_only else "  not append-only"
        if case.reason:
            row += f"  ({case.reason})"
        lines.append(row)
        if case.mismatch is not None:
            m = case.mismatch
            where = f"token {m.position}" if m.position is not None else "-"
            lines.append(f"      turn {m.turn}, {m.stage}, at {where}: {m.detail}")
            if m.expected:
                lines.append(f"        template: {m.expected}")
            if m.got:
                lines.append(f"        server:   {m.got}")
    counts = report.counts()
    verdict = "PASS" if report.ok else "FAIL"
    lines.append(f"  {verdict}: {counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped")
    return lines


@click.command(name="check-family")
@click.argument("name")
@click.option(
    "--tokenizer",
    "tokenizer_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Check this tokenizer folder (e.g. your checkpoint's) instead of the family's pinned one.",
)
@click.option(
    "--template",
    "template_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Use this chat template file instead of the tokenizer's own (the family's edits still apply).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the reports as JSON.")
@verbose_option
def check_family(name: str, tokenizer_dir: Path | None, template_file: Path | None, as_json: bool) -> None:
    """Check that family NAME's rendering stays append-only from turn to turn (CPU).

    Plays the session server over many conversation shapes (plain, tool calls, parallel calls,
    thinking on/off, a retried turn, with and without a system prompt) and compares its ids with
    rendering the whole conversation, token by token. Without --tokenizer it runs on the family's
    pinned offline tokenizer and every pinned template revision. Exits 1 if any case fails.
    """
    from miles_envs.families.check import check_registered

    reports = check_registered(name, tokenizer_dir, template_file)
    if as_json:
        click.echo(json.dumps([report.to_json() for report in reports], indent=2, ensure_ascii=False))
    else:
        for index, report in enumerate(reports):
            if index:
                click.echo("")
            for line in _table(report):
                click.echo(line)
    if not all(report.ok for report in reports):
        raise SystemExit(1)
