#!/usr/bin/env bash
# Read-only device check: "help us verify your GPU".
#
# Runs `mig-spawner doctor --json`, `status --json` and `catalog --from-driver --json`,
# keeps their output in OUT_DIR, prints each GPU's profile table as the driver gives it
# (memory in MiB, SMs, copy engines and the media engines: decoders, encoders, JPEG,
# OFA) and where it differs from mig-spawner's catalog. It never changes MIG mode,
# instances or anything else: every command it runs only reads NVML. Exit 0 when all
# three could read the GPUs.
#
#   scripts/device-check.sh                      # the real driver
#   MIG_SPAWNER_SIMULATE=h200x1 scripts/device-check.sh   # the simulator, to try it
#
# Environment: MIG_SPAWNER (the command, default "mig-spawner"), OUT_DIR (where the
# JSON goes, default a new temporary directory).
set -u

umask 077  # the files name GPUs and UUIDs of this host: not for everyone to read
CLI=${MIG_SPAWNER:-mig-spawner}
OUT_DIR=${OUT_DIR:-$(mktemp -d -t mig-device-check.XXXXXX)}
mkdir -p "$OUT_DIR"
read_failed=0

run() {  # run NAME ARGS...: keep stdout as NAME.json, stderr as NAME.err
  local name=$1; shift
  # shellcheck disable=SC2086  # CLI may be "python -m mig_spawner.cli.main"
  $CLI "$@" >"$OUT_DIR/$name.json" 2>"$OUT_DIR/$name.err"
  echo $?
}

doctor_rc=$(run doctor doctor --json)
status_rc=$(run status status --json)
catalog_rc=$(run catalog-from-driver catalog --from-driver --json)

python3 - "$OUT_DIR" "$doctor_rc" "$status_rc" "$catalog_rc" <<'PY' || read_failed=1
import json, pathlib, sys

out = pathlib.Path(sys.argv[1])
doctor_rc, status_rc, catalog_rc = (int(x) for x in sys.argv[2:5])
ok = True


def load(name):
    global ok
    try:
        return json.loads((out / f"{name}.json").read_text())
    except (OSError, ValueError):
        err = (out / f"{name}.err").read_text().strip()
        print(f"could not read {name}: {err or 'no output'}")
        ok = False
        return None


doctor = load("doctor")
if doctor is not None:
    nvml = next((c for c in doctor["checks"] if c["name"] == "NVML"), None)
    if nvml is None or nvml["status"] == "fail":
        print(f"NVML could not be read: {nvml and nvml['detail']}")
        ok = False
    for c in doctor["checks"]:
        print(f"[{c['status'].upper()}] {c['name']}: {c['detail']}")
if status_rc != 0 or load("status") is None:
    ok = False
table = load("catalog-from-driver") if catalog_rc == 0 else None
if table is None:
    ok = False
else:
    print(f"\ndriver {table['driver_version']}")
    for gpu in table["gpus"]:
        head = f"GPU {gpu['index']} {gpu['product']} (catalog key {gpu['model_key']})"
        if gpu["profiles"]:
            print(f"{head}: the driver's profiles")
            print(f"  {'profile':<16} {'ID':>3} {'MiB':>7} {'SM':>4} {'CE':>3} "
                  f"{'DEC':>4} {'ENC':>4} {'JPEG':>4} {'OFA':>4} {'inst':>4}")
            for r in gpu["profiles"]:
                print(f"  {r['profile']:<16} {r['id']:>3} {r['memory_mib']:>7} "
                      f"{r['sm_count']:>4} {r['copy_engines']:>3} {r['decoders']:>4} "
                      f"{r['encoders']:>4} {r['jpeg']:>4} {r['ofa']:>4} "
                      f"{r['max_instances']:>4}")
        if not gpu["profiles"]:
            print(f"{head}: no MIG profiles listed (MIG off or not supported)")
        elif gpu["model_key"] is None:
            print(f"{head}: not in the catalog; please send catalog-from-driver.json")
        elif gpu["differences_from_catalog"]:
            print(f"{head}: differs from the catalog:")
            for line in gpu["differences_from_catalog"]:
                print(f"  {line}")
        else:
            print(f"{head}: matches the catalog")
print(f"\noutput kept in {out}; attach the three .json files to a report")
sys.exit(0 if ok else 1)
PY
exit $read_failed
