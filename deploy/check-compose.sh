#!/usr/bin/env bash
# Runs compose.yaml for real and drives it as an operator would, then takes it down:
#   build the image; up; both groups training; torchft's Lighthouse port reached from the job's
#   network and not from the front one; a kill-heal drill over REST (fingerprints equal);
#   restart the control plane (its history kept, the agents reconnect); SIGKILL a group's
#   container (the group must show lost within seconds, then train again, healed, once the engine
#   restarts the container); down, volumes included.
# Every step prints what it saw and how long it took; the first that fails stops the check (exit 1)
# and everything is taken down. Deploy/VERIFIED.md records a run.
#
#   deploy/check-compose.sh
#
# Needs Docker Compose v2.24+ (or podman-compose 1.6+), curl and python3, and the right to signal
# the containers' processes (root with a rootful engine). It runs as its own compose project
# (ftctl-check) but publishes the compose file's ports (8000, 9090, 3000): stop a running
# deployment first. Settings, by environment:
#   COMPOSE      the compose command (default: "docker compose" if it answers, else podman-compose)
#   SERVICES     which services (default: every one; "lighthouse controlplane group0 group1" where
#                the Prometheus and Grafana images cannot be pulled)
#   SKIP_BUILD=1 use the ftctl:local image already built
#   TORCH_INDEX  reaches the build, as with compose itself
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${COMPOSE:-}" ]]; then
  if docker compose version >/dev/null 2>&1; then COMPOSE="docker compose"; else COMPOSE="podman-compose"; fi
fi
read -r -a compose <<<"$COMPOSE"
engine=docker
[[ "${compose[0]}" == podman* ]] && engine=podman
project=ftctl-check
api=http://127.0.0.1:8000/api/v1
started=$(date +%s)

say() { printf '[%4ds] %s\n' "$(($(date +%s) - started))" "$*"; }
fail() { say "FAILED: $*"; exit 1; }
c() { "${compose[@]}" -p "$project" "$@"; }

made_env=""
if [[ ! -f .env ]]; then
  made_env=1
  printf 'FTCTL_TOKEN=%s\n' "$(python3 -c 'import secrets; print(secrets.token_urlsafe(24))')" >.env
fi
token=$(sed -n 's/^FTCTL_TOKEN=//p' .env | tail -1)
[[ ${#token} -ge 16 ]] || fail ".env's FTCTL_TOKEN is shorter than 16 characters"

teardown() {
  say "down (volumes included)"
  c down -v >/dev/null 2>&1 || true
  [[ -n "$made_env" ]] && rm -f .env
}
trap teardown EXIT

# GET (or POST with a JSON body) on the control plane; prints the JSON, or nothing when it does not answer
call() {
  local method=$1 path=$2 body=${3:-}
  curl -fsS --max-time 10 -X "$method" -H "Authorization: Bearer $token" -H 'Content-Type: application/json' \
    ${body:+--data "$body"} "$api$path" 2>/dev/null || true
}
# a Python expression over the JSON `j` (printed), e.g.: json_get "$groups" '[g["state"] for g in j]'
json_get() { python3 -c 'import json, sys; j = json.loads(sys.argv[1] or "null"); print(eval(sys.argv[2]))' "$1" "$2"; }
# wait_for SECONDS WHAT COMMAND...: until the command succeeds
wait_for() {
  local seconds=$1 what=$2; shift 2
  local deadline=$(($(date +%s) + seconds))
  until "$@"; do
    (($(date +%s) < deadline)) || fail "$what: not within ${seconds}s"
    sleep 1
  done
}
state_of() { json_get "$(call GET /groups)" "{g['group']: g['state'] for g in (j or [])}.get($1)"; }
both_training() { [[ "$(state_of 0)" == training && "$(state_of 1)" == training ]]; }
container_of() { "$engine" ps -q --filter "label=com.docker.compose.project=$project" --filter "label=com.docker.compose.service=$1"; }

if [[ -z "${SKIP_BUILD:-}" ]]; then
  say "build"
  c build lighthouse
fi
say "up: ${SERVICES:-every service}"
# shellcheck disable=SC2086  # SERVICES is a list of names
c up -d ${SERVICES:-} >/dev/null
wait_for 300 "both groups training" both_training
say "both groups training"

# torchft's own Lighthouse port (no authentication, a kill route) from a container on each network
reaches_lighthouse() {
  "$engine" run --rm --network "${project}_$1" ftctl:local \
    python -c "import socket; socket.create_connection(('lighthouse', 29510), 3)" >/dev/null 2>&1
}
reaches_lighthouse job || fail "no container on the job network reaches the Lighthouse"
! reaches_lighthouse front || fail "torchft's Lighthouse port is reachable from the front network (Grafana's)"
say "torchft's Lighthouse port: reached from the job network, not from the front network"

drill=$(call POST /drills '{"kind": "kill-heal", "group": 1}')
id=$(json_get "$drill" 'j["id"]') || fail "the drill did not start: $drill"
drill_done() { drill=$(call GET "/drills/$id"); [[ "$(json_get "$drill" 'j["status"]')" != running ]]; }
wait_for 300 "the kill-heal drill to end" drill_done
[[ "$(json_get "$drill" 'j["status"], j["fingerprints_equal"]')" == "('done', True)" ]] || fail "kill-heal drill: $drill"
say "kill-heal drill: $(json_get "$drill" '", ".join("%s %.2fs" % (k, j["report"][k]) for k in ("detect_s", "survivors_resume_s", "kill_to_full_s"))'), fingerprints equal"

events_before=$(json_get "$(call GET '/events?limit=1000')" 'len(j["events"])')
say "restart the control plane ($events_before events before)"
c restart controlplane >/dev/null
wait_for 60 "the control plane to answer again" curl -fs --max-time 2 -o /dev/null http://127.0.0.1:8000/healthz
kept=$(json_get "$(call GET "/drills/$id")" 'j["status"]')
[[ "$kept" == done ]] || fail "the drill's record after the restart: $kept"
wait_for 60 "both groups training after the restart" both_training
events_after=$(json_get "$(call GET '/events?limit=1000')" 'len(j["events"])')
((events_after >= events_before)) || fail "events before the restart: $events_before, after: $events_after"
say "control plane back: its history kept ($events_after events, the drill's record), both groups training"

container=$(container_of group1)
[[ -n "$container" ]] || fail "no container for group1"
pid=$("$engine" inspect -f '{{.State.Pid}}' "$container")
say "SIGKILL group1's container (its PID 1, host pid $pid)"
killed_at=$(date +%s)
kill -9 "$pid"
lost() { [[ "$(json_get "$(call GET /groups/1)" 'j["state"], j["down_reason"]')" == "('down', 'lost')" ]]; }
wait_for 60 "group 1 to show lost" lost
say "group 1 shown down (lost: its agent silent, no heartbeat) after $(($(date +%s) - killed_at))s"
healed_since_kill() {
  [[ "$(state_of 1)" == training ]] && \
    [[ "$(json_get "$(call GET /groups/1)" "(j.get('last_heal') or {}).get('ts', 0) > $killed_at")" == True ]]
}
wait_for 300 "group 1 to come back by itself and heal" healed_since_kill
say "group 1 training again after $(($(date +%s) - killed_at))s, healed from a peer; container restarts: $("$engine" inspect -f '{{.RestartCount}}' "$container")"
say "OK"
