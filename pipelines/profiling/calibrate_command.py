"""``pipelines calibrate``: measure a Triton server and save its profile."""

from __future__ import annotations

import argparse

from ..commands.interrupts import sigterm_as_interrupt
from ..commands.output_paths import output_file, same_file
from ..errors import ArgumentError
from .calibrate import ProbesNotDeployed, calibrate
from .measure import Budget
from .probes import CHAINS, SIZES

__all__ = ["QUICK", "add_arguments", "main"]

#: ``--quick``: fewer, shorter probes (about half the time), for a first look or a check.
QUICK = {"chains": (1, 4, 8), "sizes": (1 << 10, 1 << 20, 4 << 20, 8 << 20, 16 << 20),
         "budget": Budget(rounds=5, max_requests=3, seconds=0.2)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", metavar="HOST:PORT",
                        help="calibrate the Triton server there (default: the bundled server); the probe "
                        "repository is written to --probes first if the server does not serve it yet")
    parser.add_argument("--protocol", choices=["http", "grpc"], default="http",
                        help="the protocol the profile is for (default: http)")
    parser.add_argument("--out", required=True, metavar="PROFILE.json", help="where to save the profile")
    parser.add_argument("--plot", metavar="PNG",
                        help="where to draw cost against bytes per boundary (default: PROFILE.png beside --out)")
    parser.add_argument("--probes", metavar="DIR", default="probe_repository",
                        help="where to write the probe repository for a remote server (default: probe_repository)")
    parser.add_argument("--quick", action="store_true", help="fewer and shorter probes (about half the time)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    options = QUICK if args.quick else {"chains": CHAINS, "sizes": SIZES, "budget": Budget()}
    # Checked before minutes of measuring, which a path that cannot be written would lose.
    out = output_file(args.out, "--out")
    plot = output_file(args.plot if args.plot else out.with_suffix(".png"), "--plot")
    if same_file(out, plot):
        raise ArgumentError(
            f"--out and --plot are both {str(out)!r}: the plot would be drawn over the profile. "
            "Give --out a .json name, or --plot another file"
        )
    try:
        with sigterm_as_interrupt():  # a killed run stops its server and removes its probe repository
            profile = calibrate(args.url, args.protocol, probes_dir=args.probes, progress=not args.quiet, **options)
    except ProbesNotDeployed as exc:
        print(exc.message)
        return 3
    profile.save(out)
    profile.plot(plot)
    print(profile.table())
    print(f"wrote {out} and {plot}")
    return 0
