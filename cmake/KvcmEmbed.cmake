# Embeds a file's bytes into a binary at build time, so that it needs no file at run time.
#
#   kvcm_embed_file(TARGET FILE SYMBOL)
#     Adds to TARGET a generated source defining, with C linkage,
#       const unsigned char SYMBOL[];  the file's bytes, then a NUL
#       const size_t SYMBOL_size;      the file's length
#     regenerated whenever FILE changes.
#
# The same file run as a script (cmake -DINPUT=.. -DOUTPUT=.. -DSYMBOL=.. -P KvcmEmbed.cmake)
# writes the source.

if(CMAKE_SCRIPT_MODE_FILE)
  file(READ "${INPUT}" hex HEX)
  string(LENGTH "${hex}" hex_length)
  math(EXPR size "${hex_length} / 2")
  string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," bytes "${hex}")
  # 16 bytes a line.
  string(REGEX REPLACE "((0x[0-9a-f][0-9a-f],){16})" "\\1\n  " bytes "${bytes}")
  file(WRITE "${OUTPUT}.tmp"
       "// Generated from ${INPUT} by cmake/KvcmEmbed.cmake. Do not edit.\n"
       "#include <cstddef>\n"
       "extern \"C\" {\n"
       "extern const unsigned char ${SYMBOL}[] = {\n  ${bytes}0x00};\n"
       "extern const size_t ${SYMBOL}_size = ${size};\n"
       "}\n")
  file(RENAME "${OUTPUT}.tmp" "${OUTPUT}")
  return()
endif()

set(KVCM_EMBED_SCRIPT ${CMAKE_CURRENT_LIST_FILE})

function(kvcm_embed_file target file symbol)
  set(output ${CMAKE_CURRENT_BINARY_DIR}/${symbol}.cc)
  add_custom_command(
    OUTPUT ${output}
    COMMAND ${CMAKE_COMMAND} -DINPUT=${file} -DOUTPUT=${output} -DSYMBOL=${symbol}
            -P ${KVCM_EMBED_SCRIPT}
    DEPENDS ${file} ${KVCM_EMBED_SCRIPT}
    COMMENT "embedding ${file}"
    VERBATIM)
  target_sources(${target} PRIVATE ${output})
endfunction()
