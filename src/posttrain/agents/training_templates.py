"""Our prefix-preserving training templates: one Jinja chat template per tool-call family.

Literal template text only; ``agents/templates.py`` puts each in its family's row
(``training_template``). Reasoning is never stripped, assistant turns keep the family's call
syntax, and rendering more messages never changes what was rendered before.
"""

from __future__ import annotations

# Shared by the three templates: the text of a message's content (a string or content blocks).
_TEXT_OF = r"""
{%- macro text_of(content, image_text='') -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for block in content -%}
            {%- if block is mapping and block.type == 'text' -%}
                {{- block.text -}}
            {%- elif block is mapping and (block.type == 'image' or 'image' in block) -%}
                {{- image_text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- macro arguments_of(function) -%}
    {%- if function.arguments is string -%}
        {{- function.arguments -}}
    {%- else -%}
        {{- (function.arguments if function.arguments is defined else {}) | tojson -}}
    {%- endif -%}
{%- endmacro -%}
"""

# A run of tool messages stays open until the next message (or the generation prompt) closes it,
# so appending one more tool message never changes what was rendered before.
_QWEN_TEMPLATE = (
    _TEXT_OF
    + r"""
{%- set image_text = '<|vision_start|><|image_pad|><|vision_end|>' -%}
{%- set ns = namespace(prev='') -%}
{%- set has_system = messages and messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if has_system -%}
        {{- text_of(messages[0].content, image_text) + '\n\n' -}}
    {%- endif -%}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments '
        'within <tool_call></tool_call> XML tags:\n<tool_call>\n'
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif has_system -%}
    {{- '<|im_start|>system\n' + text_of(messages[0].content, image_text) + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role != 'tool' and ns.prev == 'tool' -%}
        {{- '<|im_end|>\n' -}}
    {%- endif -%}
    {%- if message.role == 'system' and loop.first -%}
    {%- elif message.role == 'assistant' -%}
        {%- set content = text_of(message.content, image_text) -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- generation -%}
        {%- if message.reasoning_content is string and message.reasoning_content
              and not content.lstrip().startswith('<think>') -%}
            {{- '<think>\n' + message.reasoning_content.strip('\n') + '\n</think>\n\n' -}}
        {%- elif enable_thinking is defined and enable_thinking is false -%}
            {{- '<think>\n\n</think>\n\n' -}}
        {%- endif -%}
        {{- content -}}
        {%- for call in message.tool_calls or [] -%}
            {%- set function = call.function if call.function is defined else call -%}
            {%- if content or not loop.first -%}
                {{- '\n' -}}
            {%- endif -%}
            {{- '<tool_call>\n{"name": ' + (function.name | tojson) + ', "arguments": ' -}}
            {{- arguments_of(function) -}}
            {%- if call.type is defined and call.type != 'function' -%}
                {{- ', "type": ' + (call.type | tojson) -}}
            {%- endif -%}
            {{- '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>' -}}
        {%- endgeneration -%}
        {{- '\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if ns.prev != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + text_of(message.content, image_text) + '\n</tool_response>' -}}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\n' + text_of(message.content, image_text) + '<|im_end|>\n' -}}
    {%- endif -%}
    {%- set ns.prev = message.role -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {%- if ns.prev == 'tool' -%}
        {{- '<|im_end|>\n' -}}
    {%- endif -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- endif -%}
{%- endif -%}
"""
)

# Tools go in the system prompt (Llama's ``tools_in_user_message=False`` layout); several calls in
# one turn are written as JSON objects separated by "; ".
_LLAMA3_TEMPLATE = (
    _TEXT_OF
    + r"""
{{- bos_token -}}
{%- set has_system = messages and messages[0].role == 'system' -%}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' -}}
{%- if tools -%}
    {{- 'Environment: ipython\n' -}}
{%- endif -%}
{{- 'Cutting Knowledge Date: December 2023\nToday Date: ' -}}
{{- (date_string if date_string is defined else '26 Jul 2024') + '\n\n' -}}
{%- if tools -%}
    {{- 'You have access to the following functions. To call a function, please respond with JSON '
        'for a function call. Respond in the format {"name": function name, "parameters": '
        'dictionary of argument name and its value}. Do not use variables.\n\n' -}}
    {%- for tool in tools -%}
        {{- (tool | tojson(indent=4)) + '\n\n' -}}
    {%- endfor -%}
{%- endif -%}
{%- if has_system -%}
    {{- text_of(messages[0].content) | trim -}}
{%- endif -%}
{{- '<|eot_id|>' -}}
{%- for message in messages -%}
    {%- if message.role == 'system' and loop.first -%}
    {%- elif message.role == 'assistant' -%}
        {%- set content = text_of(message.content) -%}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {%- generation -%}
        {%- if message.reasoning_content is string and message.reasoning_content
              and not content.lstrip().startswith('<think>') -%}
            {{- '<think>\n' + message.reasoning_content.strip('\n') + '\n</think>\n\n' -}}
        {%- endif -%}
        {%- if message.tool_calls -%}
            {%- if content -%}
                {{- content + '<|python_tag|>' -}}
            {%- endif -%}
            {%- for call in message.tool_calls -%}
                {%- set function = call.function if call.function is defined else call -%}
                {%- if not loop.first -%}
                    {{- '; ' -}}
                {%- endif -%}
                {{- '{"name": ' + (function.name | tojson) + ', "parameters": ' + arguments_of(function) -}}
                {%- if call.type is defined and call.type != 'function' -%}
                    {{- ', "type": ' + (call.type | tojson) -}}
                {%- endif -%}
                {{- '}' -}}
            {%- endfor -%}
        {%- else -%}
            {{- content -}}
        {%- endif -%}
        {{- '<|eot_id|>' -}}
        {%- endgeneration -%}
    {%- elif message.role == 'tool' or message.role == 'ipython' -%}
        {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' -}}
        {%- if message.content is mapping -%}
            {{- message.content | tojson -}}
        {%- else -%}
            {{- text_of(message.content) -}}
        {%- endif -%}
        {{- '<|eot_id|>' -}}
    {%- else -%}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' -}}
        {{- (text_of(message.content) | trim) + '<|eot_id|>' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
{%- endif -%}
"""
)

# After tool outputs the assistant continues without a new <｜Assistant｜> tag, as in DeepSeek's
# own templates; the outputs block is closed by whatever comes next.
_DEEPSEEK_V3_TEMPLATE = (
    _TEXT_OF
    + r"""
{{- bos_token -}}
{%- set ns = namespace(prev='') -%}
{%- set has_system = messages and messages[0].role == 'system' -%}
{%- if has_system -%}
    {{- text_of(messages[0].content) -}}
{%- endif -%}
{%- if tools -%}
    {%- if has_system -%}
        {{- '\n\n' -}}
    {%- endif -%}
    {{- '## Tools\nYou can call the following functions.' -}}
    {%- for tool in tools -%}
        {%- set function = tool.function if tool.function is defined else tool -%}
        {{- '\n\n### ' + function.name + '\nDescription: ' + (function.description or '') -}}
        {{- '\nParameters: ' + ((function.parameters or {}) | tojson) -}}
    {%- endfor -%}
    {{- '\n\nTo call functions, answer with one block of calls, one call per line:\n'
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>FUNCTION_NAME\n```json\n'
        'ARGUMENTS_AS_JSON\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role != 'tool' and ns.prev == 'tool' -%}
        {{- '<｜tool▁outputs▁end｜>' -}}
    {%- endif -%}
    {%- if message.role == 'system' and loop.first -%}
    {%- elif message.role == 'user' -%}
        {{- '<｜User｜>' + text_of(message.content) -}}
    {%- elif message.role == 'assistant' -%}
        {%- set content = text_of(message.content) -%}
        {%- if ns.prev != 'tool' -%}
            {{- '<｜Assistant｜>' -}}
        {%- endif -%}
        {%- generation -%}
        {%- if message.reasoning_content is string and message.reasoning_content
              and not content.lstrip().startswith('<think>') -%}
            {{- '<think>\n' + message.reasoning_content.strip('\n') + '\n</think>\n\n' -}}
        {%- endif -%}
        {{- content -}}
        {%- if message.tool_calls -%}
            {{- '<｜tool▁calls▁begin｜>' -}}
            {%- for call in message.tool_calls -%}
                {%- set function = call.function if call.function is defined else call -%}
                {%- if not loop.first -%}
                    {{- '\n' -}}
                {%- endif -%}
                {{- '<｜tool▁call▁begin｜>' + (call.type if call.type is defined else 'function') -}}
                {{- '<｜tool▁sep｜>' + function.name + '\n```json\n' + arguments_of(function) -}}
                {{- '\n```<｜tool▁call▁end｜>' -}}
            {%- endfor -%}
            {{- '<｜tool▁calls▁end｜>' -}}
        {%- endif -%}
        {{- '<｜end▁of▁sentence｜>' -}}
        {%- endgeneration -%}
    {%- elif message.role == 'tool' -%}
        {%- if ns.prev == 'tool' -%}
            {{- '\n' -}}
        {%- else -%}
            {{- '<｜tool▁outputs▁begin｜>' -}}
        {%- endif -%}
        {{- '<｜tool▁output▁begin｜>' + text_of(message.content) + '<｜tool▁output▁end｜>' -}}
    {%- else -%}
        {{- text_of(message.content) -}}
    {%- endif -%}
    {%- set ns.prev = message.role -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {%- if ns.prev == 'tool' -%}
        {{- '<｜tool▁outputs▁end｜>' -}}
    {%- else -%}
        {{- '<｜Assistant｜>' -}}
    {%- endif -%}
{%- endif -%}
"""
)
