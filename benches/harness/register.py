# leasehold's adapter for the job-queue benchmark harness: appended to the
# harness copy's bench_harness/adapters.py by benches/harness/install,
# which fills in the two paths. The adapter is one process, the leasehold
# binary serving a host (`leasehold bench harness-adapter`): the harness's
# SIGKILL of a replica kills a host mid-segment.
LEASEHOLD_BIN = Path(__LEASEHOLD_BIN__)
LEASEHOLD_PLUGIN = Path(__LEASEHOLD_PLUGIN__)


def build_leasehold(skip: bool) -> None:
    for what, path in (("binary", LEASEHOLD_BIN), ("test plugin", LEASEHOLD_PLUGIN)):
        if not path.is_file():
            raise RuntimeError(
                f"leasehold's {what} is missing at {path}: build it in the leasehold "
                f"checkout (cargo build --release; ./scripts/build-plugins target/plugins)"
            )


def launch_leasehold(manifest: AdapterManifest, overrides: dict[str, str]) -> LaunchSpec:
    # The host's own settings pass through the environment (LEASEHOLD_*).
    return LaunchSpec(
        argv=[str(LEASEHOLD_BIN), "bench", "harness-adapter", "--plugin-file", str(LEASEHOLD_PLUGIN)],
        env=_base_env(manifest, overrides),
    )


ADAPTERS["leasehold"] = AdapterEntry(
    bench_dir=SCRIPT_DIR / "leasehold-bench",
    builder=build_leasehold,
    launcher=launch_leasehold,
)
