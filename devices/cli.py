"""`dlfp probe`: what the device probes see, and the profile chosen from it."""
from __future__ import annotations

import json
from dataclasses import asdict

import click

from dlfp.devices.detect import detect_profile
from dlfp.devices.probes import ProbeSet


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.option("--root", default="/", show_default=True, type=click.Path(exists=True, file_okay=False),
              help="Read sysfs under this folder (a fake tree for tests).")
@click.option("--profile", default=None, help="Use this profile instead of the detected one.")
def probe(as_json: bool, root: str, profile: str | None) -> None:
    """Read every device probe once and pick a device profile."""
    from dlfp.cli import UserError

    with ProbeSet(root) as probes:
        readings = probes.read()
    try:
        detection = detect_profile(root, readings, override=profile)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if as_json:
        out = {
            "root": root,
            "readings": [{k: v for k, v in r.as_sample(0.0).items() if k != "t"} for r in readings],
            "profile": asdict(detection),
        }
        click.echo(json.dumps(out, indent=2))
        return
    for r in readings:
        click.echo(f"{r.probe:8} {r.source:22} {r.describe()}")
    how = "override" if detection.overridden else "detected"
    click.echo(f"profile: {detection.profile} ({how}: {detection.reason})")
