//! Which capture points a loader delivers: a preset's, the configured ones checked against
//! the dataset's schema, or the defaults.
use hslake_schemas::{CapturePoint, DatasetSchema};

use crate::{LoaderConfig, LoaderError};

fn list_points(s: &DatasetSchema) -> String {
    s.points
        .iter()
        .map(|p| p.column())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The auxiliary and target points: as configured, checked against the schema, or the
/// defaults (`final_norm`, else the last point, as target; every other point as aux).
pub(crate) fn resolve_points(
    url: &str,
    s: &DatasetSchema,
    c: &LoaderConfig,
) -> Result<(Vec<CapturePoint>, CapturePoint), LoaderError> {
    if let Some(preset) = c.preset {
        let p = preset.resolve(url, s)?;
        return Ok((p.aux, p.target));
    }
    let missing = |p: CapturePoint, role| LoaderError::MissingPoint {
        url: url.to_string(),
        wanted: p.column(),
        role,
        available: list_points(s),
    };
    let target = match c.target {
        Some(t) if s.point_index(t).is_none() => return Err(missing(t, "target")),
        Some(t) => t,
        None => match s.point_index(CapturePoint::FinalNorm) {
            Some(_) => CapturePoint::FinalNorm,
            None => *s
                .points
                .last()
                .ok_or_else(|| LoaderError::Config("the dataset has no capture points".into()))?,
        },
    };
    let aux = match &c.aux_layers {
        Some(list) => {
            for &p in list {
                if s.point_index(p).is_none() {
                    return Err(missing(p, "aux_layers"));
                }
            }
            list.clone()
        }
        None => s.points.iter().copied().filter(|&p| p != target).collect(),
    };
    Ok((aux, target))
}
