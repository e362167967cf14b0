//! `weft bench --kernels`: times every kernel path of each weight type and shape class on
//! this CPU (weft-kernels' `choose`), keeps the fastest (cached for later runs) and prints
//! each candidate against the machine's bandwidth and integer peak.

use anyhow::Result;
use serde_json::json;

use crate::paths::weft_home;

pub fn run(json_out: bool) -> Result<()> {
    let cache = weft_home().join("calibration");
    let r = weft_cluster::profile::select_kernels(Some(&cache), true);
    let cpu = weft_cluster::profile::cpu_model();
    if json_out {
        outln!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "cpu": cpu,
                "simd": weft_kernels::quant::simd_name(),
                "report": r,
            }))?
        )?;
        return Ok(());
    }
    let bw = r.bandwidth_bytes_per_s;
    outln!(
        "{cpu}, {} thread; kernels {}",
        r.threads,
        weft_kernels::quant::simd_name()
    )?;
    outln!("memory read bandwidth {:.1} GB/s (one stream)", bw / 1e9)?;
    match r.peak_int8_ops_per_s {
        Some(p) => outln!(
            "integer dot peak {:.0} GOPS ({})",
            p / 1e9,
            weft_kernels::roofline::peak_int8_instruction().unwrap_or("-")
        )?,
        None => outln!("integer dot peak: not measured (SIMD kernels off)")?,
    }
    outln!(
        "{:<6} {:<8} {:>6}  {:<28} {:>9} {:>7} {:>8} {:>7}  chosen",
        "type",
        "shape",
        "tokens",
        "path",
        "GB/s",
        "of bw",
        "GOPS",
        "of peak"
    )?;
    for c in &r.choices {
        // The row layout's paths (the chosen one starred), then the interleaved layout's
        // where the type is interleaved here (the one in use marked): the layers of that
        // type run it, and rows that do not interleave the starred path.
        let mark = |on: bool, what: &'static str| if on { what } else { "" };
        let rows = c
            .timed
            .iter()
            .map(|t| (t, t.path.name(), mark(Some(t.path) == c.chosen, "*")));
        let packed = c.interleaved.iter().map(|t| {
            let name = format!("interleaved {}", t.path.name());
            (
                t,
                name,
                mark(Some(t.path) == c.interleaved_chosen, "in use"),
            )
        });
        for (t, name, marked) in rows.chain(packed) {
            let of_peak = r
                .peak_int8_ops_per_s
                .filter(|_| c.ty.starts_with('Q'))
                .map_or("-".to_string(), |p| {
                    format!("{:.0}%", 100.0 * t.ops_per_s / p)
                });
            outln!(
                "{:<6} {:<8} {:>6}  {:<28} {:>9.1} {:>6.0}% {:>8.1} {:>7}  {}",
                c.ty,
                c.shape.name(),
                c.tokens,
                name,
                t.bytes_per_s / 1e9,
                100.0 * t.bytes_per_s / bw,
                t.ops_per_s / 1e9,
                of_peak,
                marked
            )?;
        }
    }
    // Attention's tile sets: the same bits, timed on a head's cached rows.
    if let Some(a) = &r.attention {
        for t in &a.timed {
            outln!(
                "{:<6} {:<8} {:>6}  {:<28} {:>9} {:>7} {:>8.1} {:>7}  {}",
                "f32",
                "attend",
                "4,32",
                format!("tiles {}", t.set.name()),
                "-",
                "-",
                t.flops_per_s / 1e9,
                "-",
                if t.set == a.chosen { "*" } else { "" }
            )?;
        }
    }
    outln!(
        "GB/s: weight bytes x tokens per second; the choices are cached in {}",
        cache.display()
    )?;
    outln!(
        "interleaved: rows repacked at load, eight a group (layers of these types, and experts \
         whose widths are whole groups; WEFT_KERNELS_NO_PACK=1 keeps ggml's layout)"
    )?;
    if r.attention.is_some() {
        outln!(
            "attend: attention's score and value tiles on one thread over a head's 1,024 cached rows of \
             128, groups of 4 and 32 queries, GOPS as 2 x multiply-adds (WEFT_KERNELS_NO_AVX512=1 \
             keeps the AVX2 tiles)"
        )?;
    }
    Ok(())
}
