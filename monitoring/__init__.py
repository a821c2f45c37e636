"""pdserve monitoring as code (import name ``pd.monitoring``).

- promql.py / stages.py: the request stages and the histograms that measure them;
- rules.py: recording rules and alerts (-> rules.yml, tested by rules_test.yml with promtool);
- grafana.py / dashboards.py: the Grafana dashboards (-> grafana/dashboards/*.json);
- generate.py: writes the generated files, ``--check`` fails when the committed ones are stale;
- render.py: ``pdserve render-dashboard``, the PD overview's main panels as a PNG (matplotlib).

Static files: prometheus.yml (scrape config: file_sd targets written by the launcher, and Ray's),
grafana/provisioning/ (datasource and dashboard provider). See README.md in this directory.
"""

if __name__ == "monitoring":  # the checkout root is on sys.path: hand the import to the real package (docs/design.md)
    from pd.util.shadowing import defer_to_installed

    defer_to_installed(__name__, __file__)
