"""The report's stylesheet (inlined into the page; no web fonts)."""

CSS = """
:root{--fg:#0f172a;--muted:#64748b;--line:#e2e8f0;--card:#fff;--bg:#f8fafc}
*{box-sizing:border-box}body{margin:0;background:var(--bg);color:var(--fg);
font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif}
main{max-width:1320px;margin:0 auto;padding:28px 32px 48px}
h1{font-size:24px;margin:0}h2{font-size:15px;margin:0 0 8px}
.sub{color:var(--muted);margin:4px 0 20px}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(280px,1fr));gap:12px;margin-bottom:18px}
.card{background:var(--card);border:1px solid var(--line);border-radius:10px;padding:12px 14px}
.card .k{color:var(--muted);font-size:12px;text-transform:uppercase;letter-spacing:.04em}
.card .v{font-size:24px;font-weight:650;margin-top:2px}.card .n{color:var(--muted);font-size:12px}
.good{color:#059669}.warn{color:#d97706}.bad{color:#dc2626}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(560px,1fr));gap:16px}
figure{margin:0;background:var(--card);border:1px solid var(--line);border-radius:10px;padding:14px}
figcaption{color:var(--muted);font-size:12px;margin-top:4px}
svg.chart{width:100%;height:auto;display:block}
svg .grid{stroke:#eef2f7}svg .base{stroke:#94a3b8}svg .bg{fill:#f8fafc}
svg .tick{font-size:11px;fill:#64748b}svg .axis{font-size:12px;fill:#334155}
svg .legend{font-size:12px;fill:#334155}svg .mark{font-size:11px}
svg .empty{font-size:15px;fill:#94a3b8}
.bar{display:flex;height:22px;border-radius:6px;overflow:hidden;border:1px solid var(--line)}
.bar span{display:block;height:100%}.keys{display:flex;flex-wrap:wrap;gap:14px;margin-top:8px;
font-size:12px;color:#334155}.keys i{display:inline-block;width:10px;height:10px;border-radius:2px;
margin-right:5px;vertical-align:-1px}
section{margin:18px 0}table{border-collapse:collapse;width:100%;background:var(--card);
border:1px solid var(--line);border-radius:10px;overflow:hidden;font-size:13px}
th,td{text-align:left;padding:6px 10px;border-bottom:1px solid var(--line)}th{background:#f1f5f9}
.emptypage{background:var(--card);border:1px dashed #cbd5e1;border-radius:12px;padding:40px;
text-align:center;color:var(--muted);font-size:16px}
footer{color:var(--muted);font-size:12px;margin-top:28px}
"""
