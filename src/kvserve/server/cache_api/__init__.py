"""The cache's own endpoints: status views, pins and the dashboard."""
