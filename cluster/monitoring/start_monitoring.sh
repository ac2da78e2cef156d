#!/usr/bin/env bash
# Start Prometheus and Grafana on the Ray head node with the configuration files Ray writes for them
# (Ray's "Collecting and monitoring metrics" guide), so the dashboard's Metrics view works.
# Run after `ray start --head` with RAY_GRAFANA_HOST / RAY_PROMETHEUS_HOST set (cluster YAML does both).
set -euo pipefail
METRICS=/tmp/ray/session_latest/metrics
for _ in $(seq 120); do
    [ -f "$METRICS/prometheus/prometheus.yml" ] && [ -f "$METRICS/grafana/grafana.ini" ] && break
    sleep 1
done
[ -f "$METRICS/prometheus/prometheus.yml" ] || { echo "Ray wrote no metrics config under $METRICS" >&2; exit 1; }
# Prometheus: scrapes every Ray node listed in /tmp/ray/prom_metrics_service_discovery.json
nohup prometheus --config.file="$METRICS/prometheus/prometheus.yml" \
    --storage.tsdb.path=/tmp/prometheus-data --web.listen-address=127.0.0.1:9090 \
    > /tmp/prometheus.log 2>&1 &
# Grafana: Ray's grafana.ini allows embedding and anonymous viewing, and provisions the Prometheus
# datasource and Ray's dashboards from $METRICS/grafana/provisioning
nohup grafana server --homepath /opt/grafana --config "$METRICS/grafana/grafana.ini" \
    > /tmp/grafana.log 2>&1 &
echo "prometheus on 127.0.0.1:9090 (log /tmp/prometheus.log), grafana on :3000 (log /tmp/grafana.log)"
